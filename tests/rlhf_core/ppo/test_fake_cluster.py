"""A fake cluster (issue 35): a local Ray that advertises 4 GPUs this host does not have, so the roles plan GPU bundles
while they run on the CPU. Here: the driver's bounded waits on real actors (item 4), TP workers each loading their
shard over the weight group (item 3), each rank fetching its own checkpoint files and the final model streamed
through rank 0 (item 8). The hybrid engine's moments on the same kind of cluster: test_hybrid_moments.py."""
from __future__ import annotations

import time

import pytest

from rlhf_core.ppo.placement import RoleError, wait_all

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fake_cluster():
    """A local Ray advertising 4 GPUs; the stages join it by its address (and so ask it, not this host)."""
    import os

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ctx = ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, object_store_memory=200 * 1024 ** 2)
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()


class Slow:
    def wait(self, s: float) -> float:
        time.sleep(s)
        return s

    def fail(self) -> None:
        raise ValueError("engine died")


def test_a_call_that_never_answers_fails_naming_the_role_and_the_phase(fake_cluster):
    """placement.wait_all on real actors: a silent one after the timeout (naming it and the phase), a failing one
    at once, engines named first."""
    import ray

    a, b, c = (ray.remote(Slow).options(num_cpus=0).remote() for _ in range(3))
    ray.get([x.wait.remote(0) for x in (a, b, c)])  # started (an actor's start is not what is timed)
    t0 = time.monotonic()
    with pytest.raises(RoleError, match=r"^rollout0 did not answer within 1 s while entering sync"):
        wait_all([a.wait.remote(0.01), b.wait.remote(60)], ["policy0", "rollout0"], "entering sync", 1.0)
    assert time.monotonic() - t0 < 20
    with pytest.raises(RoleError, match=r"rollout1 failed while a weight sync \(.*engine died"):
        wait_all([a.wait.remote(0.01), c.fail.remote()], ["policy0", "rollout1"], "a weight sync", 30.0)
    assert wait_all([a.wait.remote(0.01)], ["policy0"], "train", 30.0) == [0.01]
    for x in (a, b, c):
        ray.kill(x)


# ---------------------------------------------------------------------------------------------- TP workers (item 3)
class TPWorker:
    """Stands in for one of vLLM's TP workers with its NCCL weight-transfer engine (vLLM 0.32's Worker API and the
    unpacked receive of vllm.distributed.weight_transfer.nccl_engine), over gloo: the group joined as rank
    rank_offset + its TP rank, each update's parameters received in order by broadcast, and loaded as vLLM's
    column-parallel loaders do: its own slice of dim 0 (the whole tensor where dim 0 does not split)."""

    def __init__(self, tp_rank: int, tp: int):
        self.tp_rank, self.tp, self.shards, self.updates, self.active = tp_rank, tp, {}, 0, False

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        from rlhf_core.ppo import weight_sync

        self.pg = weight_sync.group(init_info["master_address"], init_info["master_port"],
                                    init_info["rank_offset"] + self.tp_rank, init_info["world_size"])

    def start_weight_update(self) -> None:
        self.active = True

    def update_weights(self, update_info: dict) -> None:
        import torch

        from rlhf_core.ppo import weight_sync

        assert self.active, "update_weights before start_weight_update"
        for name, dt, shape in zip(update_info["names"], update_info["dtype_names"], update_info["shapes"]):
            full = torch.empty(shape, dtype=getattr(torch, dt))
            weight_sync.broadcast(self.pg, full)
            n = full.shape[0] // self.tp if full.dim() and full.shape[0] % self.tp == 0 else None
            self.shards[name] = full.narrow(0, self.tp_rank * n, n).clone() if n else full

    def finish_weight_update(self) -> None:
        self.active, self.updates = False, self.updates + 1

    def held(self) -> tuple[int, dict]:
        return self.updates, self.shards


class TPEngine:
    """An engine of TP workers: its weight path is VLLMRollout's TP branch, weight_sync.transfer_engine_join /
    transfer_engine_receive over `_rpc` (collective_rpc there: every worker runs the method)."""

    def __init__(self, tp: int):
        import ray

        self.workers = [ray.remote(TPWorker).options(num_cpus=0).remote(k, tp) for k in range(tp)]

    def _rpc(self, method: str, kwargs: dict):
        import ray

        return ray.get([getattr(w, method).remote(**kwargs) for w in self.workers])

    def join_weights(self, addr, port, rank, world, layout) -> int:
        from rlhf_core.ppo import weight_sync

        self.layout = layout
        weight_sync.transfer_engine_join(self._rpc, addr, port, rank, world)
        return rank

    def receive_weights(self) -> int:
        from rlhf_core.ppo import weight_sync

        weight_sync.transfer_engine_receive(self._rpc, self.layout)
        return 1

    def held(self) -> list:
        import ray

        return ray.get([w.held.remote() for w in self.workers])


def test_tp_workers_each_load_their_shard_over_the_weight_group(fake_cluster, tiny):
    """issue 35 item 3 on CPU: 2 ZeRO-3 policy ranks (real DeepSpeed learners) and 2 engines of TP 2 (stand-ins for
    vLLM's workers, Ray actors): CollectiveSync lays out the group (engine j's TP rank k is rank 1 + 2j + k of 5),
    rank 0 sends every parameter in buckets of 1 MB while both ranks gather each bucket in turn; after each of two
    updates every worker holds exactly its dim-0 shard of the learner's gathered weights (the whole tensor where
    dim 0 does not split), and the weights did change."""
    import ray
    import torch
    from types import SimpleNamespace

    from rlhf_core.ppo import loop, weight_sync
    from rlhf_core.ppo.roles import Learner
    from tests.rlhf_core.ppo.test_weight_sync import config, experience

    cfg = config(zero_stage=3, actor_num_gpus_per_node=2)
    policy = [ray.remote(Learner).options(num_cpus=0).remote("policy", r, 2) for r in range(2)]
    engines = [ray.remote(TPEngine).options(num_cpus=0).remote(2) for _ in range(2)]
    try:
        addr, port = ray.get(policy[0].rendezvous.remote())
        ray.get([a.setup.remote(str(tiny.policy_dir), loop.learner_settings(cfg), addr, port, 4) for a in policy])
        names = {id(a): n for a, n in zip(policy + engines, ["policy0", "policy1", "rollout0", "rollout1"])}
        roles = SimpleNamespace(policy=policy, rollouts=engines, wait=lambda refs, actors, what, error=RoleError, timeout_s=None:
                                wait_all(refs, [names[id(a)] for a in actors], what, 300, error))
        sync = weight_sync.CollectiveSync(roles, 2 ** 20, tp=2)
        assert len(sync.layout) > 1
        before = None
        for step in range(2):
            ray.get([a.train.remote(s, 0.0) for a, s in zip(policy, loop._split(experience(step), 2))])
            sync.sync()
            full = ray.get([a._full_state_dict.remote() for a in policy])[0]
            assert before is None or not torch.equal(full["model.layers.0.mlp.up_proj.weight"],
                                                     before["model.layers.0.mlp.up_proj.weight"])
            before = full
            sent = {n for b in sync.layout for n, _, _ in b}
            for j, workers in enumerate(ray.get([e.held.remote() for e in engines])):
                for k, (updates, shards) in enumerate(workers):
                    assert updates == step + 1 and set(shards) == sent, (j, k)
                    for name, got in shards.items():
                        want = full[name]
                        if want.dim() and want.shape[0] % 2 == 0:
                            want = want.narrow(0, k * want.shape[0] // 2, want.shape[0] // 2)
                        assert torch.equal(got, want), f"rollout{j}.tp{k}: {name}"
    finally:
        for a in policy + engines:
            ray.kill(a)


# ---------------------------------------------------------------------------------------------- checkpoint IO (item 8)
def _rss() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _save_with_peak(learner, uri: str):
    """Learner.save_model in this actor while a thread samples its resident memory: (peak above the start, names)."""
    import threading

    start, peak, stop = _rss(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        names = learner.save_model(uri, "")
    finally:
        stop.set()
        t.join()
    return max(peak[0], _rss()) - start, names


def _fetched(learner, uri: str) -> dict:
    from rlhf_core.ppo import node_store

    d = node_store._rank_dir(learner, "resume", uri)
    return {p.relative_to(d).as_posix().split("/", 1)[1]: p.stat().st_size for p in d.rglob("*") if p.is_file()}


def test_each_rank_fetches_its_own_checkpoint_files_and_the_model_streams_through_rank_0(fake_cluster, tiny, tmp_path):
    """issue 35 item 8, 2 ZeRO-3 ranks of a 15M-parameter policy (62 MB fp32): on resume each rank downloads only
    the files it loads (its own optimizer and module partitions), not the other's, and loading them puts back the
    weights of the checkpoint; the final save streams one 4 MB bucket at a time through rank 0 into sharded
    safetensors that load as the learner's weights, and neither rank's resident memory grows by half the model
    during it (a full CPU copy of the state dict on every rank, and a gather of every parameter at once, did)."""
    import shutil

    import ray
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlhf_core.ppo import loop
    from rlhf_core.ppo.roles import Learner
    from rlhf_core.train import checkpoints
    from tests.rlhf_core.ppo.test_weight_sync import config, experience

    model_dir = tmp_path / "policy15m"
    shutil.copytree(tiny.tokenizer_dir, model_dir)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=8000, hidden_size=384, intermediate_size=1536,
                                                 num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2,
                                                 tie_word_embeddings=False)).save_pretrained(str(model_dir))
    model_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    cfg = config(zero_stage=3, actor_num_gpus_per_node=2, weight_sync_bucket_mb=4)
    policy = [ray.remote(Learner).options(num_cpus=0).remote("policy", r, 2) for r in range(2)]
    try:
        addr, port = ray.get(policy[0].rendezvous.remote())
        ray.get([a.setup.remote(str(model_dir), loop.learner_settings(cfg), addr, port, 4) for a in policy])
        ray.get([a.train.remote(s, 0.0) for a, s in zip(policy, loop._split(experience(0), 2))])
        saved = ray.get([a._full_state_dict.remote() for a in policy])[0]
        ckpt = str(tmp_path / "ckpt")
        files = [f for part in ray.get([a.save_checkpoint.remote(ckpt, "step-1") for a in policy]) for f in part]
        checkpoints.commit(ckpt, "step-1", "fp", files, {"step": 1})
        meta = checkpoints.latest(ckpt, "fp")
        assert ray.get([a.load_checkpoint.remote(meta, fetch=True) for a in policy]) == [None, None]
        got = ray.get([a.__ray_call__.remote(_fetched, meta["uri"]) for a in policy])
        loadable = {f["path"]: f["size"] for f in meta["files"] if f["path"].endswith(".pt")}
        for r in range(2):
            assert got[r] == {f["path"]: f["size"] for f in checkpoints.rank_files(meta["files"], "actor/", r)}
            assert any(f"zero_pp_rank_{r}_" in p for p in got[r]) and not any(f"zero_pp_rank_{1 - r}_" in p for p in got[r])
            assert sum(got[r].values()) < 0.6 * sum(loadable.values())
        assert set(got[0]) | set(got[1]) == set(loadable)  # every file is some rank's, each verified there
        ray.get([a.train.remote(s, 0.0) for a, s in zip(policy, loop._split(experience(1), 2))])  # move away
        ray.get([a.load_checkpoint.remote(meta) for a in policy])
        back = ray.get([a._full_state_dict.remote() for a in policy])[0]
        assert all(torch.equal(back[k], saved[k]) for k in saved)

        out = ray.get([a.__ray_call__.remote(_save_with_peak, str(tmp_path / "model")) for a in policy])
        (grew0, names), (grew1, none) = out
        assert none == [] and "model.safetensors.index.json" in names and sum("-of-" in n for n in names) > 5
        assert grew0 < 0.5 * model_bytes and grew1 < 0.5 * model_bytes, (grew0, grew1, model_bytes)
        from rlhf_core.ppo import node_store

        local = ray.get(policy[0].__ray_call__.remote(lambda me: str(node_store._rank_dir(me, "model", f"{tmp_path / 'model'}/"))))
        reloaded = AutoModelForCausalLM.from_pretrained(local).state_dict()
        assert all(torch.equal(reloaded[k], back[k]) for k in back)
    finally:
        for a in policy:
            ray.kill(a)
