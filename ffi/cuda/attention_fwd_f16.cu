// The f16 forward attention launcher and the kernels it launches (attention_launch.cuh): a
// translation unit of its own, compiled in parallel with the other passes and dtypes.
#include "cuda/attention_launch_impl.cuh"

template struct rlx::cuda::AttentionFwd<__half>;
