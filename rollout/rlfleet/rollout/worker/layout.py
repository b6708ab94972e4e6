"""How a rollout pod spreads vLLM over the devices it is given. Pure: no I/O.

A lent serving replica brings `gpusPerReplica` GPUs (8 on an H100 node). One engine with
tensor parallelism across all of them runs any model that fits them, but a model that
fits fewer GPUs samples more tokens per second as several independent engines: each
engine's layers all-reduce over fewer GPUs and each has its own batch. So a pod runs the
smallest tensor-parallel size whose share of the weights leaves room for the KV cache,
and as many such engines as that leaves GPUs for; `choose` says which and why.

Expert parallelism is not chosen: on the locked vLLM's CPU backend a two-worker MoE engine
with `enable_expert_parallel` loses a worker at its first step, and no GPU was at hand to
show it works there (the weight reload and the routed-expert capture included). MoE
engines shard every expert across the tensor-parallel group instead.
"""

from __future__ import annotations

from dataclasses import dataclass

# A GPU's memory given to weights; the rest holds the KV cache, activations and workspace.
# vLLM takes 90 % of the GPU by default, and a KV cache smaller than the weights starves
# the batch of a long-context agent.
WEIGHT_SHARE = 0.45
GIB = 1 << 30


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int  # workers (devices) per engine
    engines: int  # independent engines in the pod
    reason: str  # one line for the log: the sizes that made the choice


def choose(
    weight_bytes: int,
    gpus: int,
    gpu_bytes: int,
    attention_heads: int,
    tensor_parallel: int | None = None,
) -> Layout:
    """The layout for a model of `weight_bytes` on `gpus` GPUs of `gpu_bytes` each (0 GPUs:
    vLLM's CPU backend). `tensor_parallel` is the worker's setting, if it names one.

    Every GPU is used: the tensor-parallel size divides `gpus`. It must also divide the
    model's attention heads (vLLM splits heads between workers)."""
    if tensor_parallel is not None:
        if gpus and gpus % tensor_parallel:
            raise ValueError(
                f"tensor_parallel {tensor_parallel} does not divide the pod's {gpus} GPUs"
            )
        if attention_heads % tensor_parallel:
            raise ValueError(
                f"tensor_parallel {tensor_parallel} does not divide the model's "
                f"{attention_heads} attention heads"
            )
        engines = gpus // tensor_parallel if gpus else 1
        return Layout(tensor_parallel, engines, f"tensor_parallel {tensor_parallel} as set")
    if not gpus:
        return Layout(1, 1, "no GPU: one engine on the CPU")
    sizes = [tp for tp in range(1, gpus + 1) if gpus % tp == 0 and attention_heads % tp == 0]
    budget = WEIGHT_SHARE * gpu_bytes
    fits = [tp for tp in sizes if weight_bytes / tp <= budget]
    tp = fits[0] if fits else sizes[-1]
    share = f"{weight_bytes / tp / GIB:.1f} GiB of weights per GPU of {gpu_bytes / GIB:.0f} GiB"
    if not fits:
        reason = f"{share}: more than the {WEIGHT_SHARE:.0%} left beside the KV cache"
    else:
        reason = f"{share}, within {WEIGHT_SHARE:.0%} of it"
    return Layout(tp, gpus // tp, reason)


def cpu_binds(cpus: list[int], workers: int) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` for `workers` CPU workers: the process's CPUs in
    as many disjoint groups (vLLM's own binding wants a NUMA node per worker)."""
    if workers > len(cpus):
        raise ValueError(f"{workers} CPU workers need as many CPUs; this process has {len(cpus)}")
    ordered, groups = sorted(cpus), []
    for index in range(workers):
        group = ordered[index * len(ordered) // workers : (index + 1) * len(ordered) // workers]
        groups.append(",".join(map(str, group)))
    return "|".join(groups)


def engine_devices(devices: list[str], layout: Layout) -> list[list[str]]:
    """The devices (CUDA_VISIBLE_DEVICES entries) of each of the layout's engines."""
    tp = layout.tensor_parallel
    return [devices[index * tp : (index + 1) * tp] for index in range(layout.engines)]
