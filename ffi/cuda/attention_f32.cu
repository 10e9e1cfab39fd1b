// The f32 attention launchers (the generic kernels only: attention_launch.cuh), forward and backward.
#include "cuda/attention_launch_impl.cuh"

template struct rlx::cuda::AttentionFwd<float>;
template struct rlx::cuda::AttentionBwd<float>;
