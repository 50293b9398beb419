"""num_gpus all (issue 43 follow-up): every GPU of each node, as OpenRLHF's `deepspeed --module` without --num_gpus
runs. The config validates what a count would refuse (the world size is not known yet); the launch counts the GPUs
(one process on a host without them), runs the world-size checks and names the size it resolved to; the deepspeed
launcher gets no --num_gpus, torchrun --nproc_per_node gpu. (A whole training job on num_gpus all:
tests/stages/test_lora_zero3.py's dpo, one rank on a host without GPUs.)"""
import re

import pytest
import torch
from pydantic import ValidationError

from rlhf_core import store
from rlhf_core.demo import demo_task
from rlhf_core.runtime import jobs
from rlhf_core.train import launch
from stages import dpo, kto, reference, sft, train_rm
from tests.stages.test_dpo import pairs_data
from tests.stages.test_sft import sft_data

HERE = torch.cuda.device_count()  # this host's GPUs: 0 on the CPU machines


def test_all_validates_and_the_launch_resolves_it_on_this_host(tiny, tmp_path):
    base = dict(policy_uri=tiny.policy_uri, dataset_uri="d", output_uri="o", train_batch_size=16, micro_train_batch_size=4)
    ring = dict(ring_attn_size=4, packing_samples=True)
    with pytest.raises(ValidationError, match=r"ring_attn_size 4 does not divide the world size 1 \(num_gpus x num_nodes\)"):
        sft.Config(**base, **ring, num_gpus=1)
    cfg = sft.Config(**base, **ring, num_gpus="all")  # the count is the cluster's: checked at launch
    assert cfg.num_gpus == "all" and sft.Config(**base, num_gpus="4").num_gpus == 4
    for cls in (dpo.Config, kto.Config):
        assert cls(**base, num_gpus="all").num_gpus == "all"
    rm = {("base_uri" if k == "policy_uri" else k): v for k, v in base.items()}
    assert train_rm.Config(**rm, num_gpus="all").num_gpus == "all"
    for bad in (0, "0", "every"):
        with pytest.raises(ValidationError, match="num_gpus"):
            sft.Config(**base, num_gpus=bad)
    with pytest.raises(ValidationError, match=r"train_batch_size 18 is not divisible by micro_train_batch_size 4 "
                                              r"\(num_gpus all: nor by it x any world size\)"):
        sft.Config(**{**base, "train_batch_size": 18}, num_gpus="all")

    world, how = jobs.world_size("all")
    ds = jobs.launcher_command("rlhf_core.train.entry", ["spec"], "deepspeed", "all")
    tr = jobs.launcher_command("rlhf_core.train.entry", ["spec"], "torchrun", "all")
    if HERE == 0:  # one process: no launcher at all, as for num_gpus 1
        assert (world, how) == (1, "num_gpus all: no GPU on this host, 1 process per node x 1 node(s)")
        assert ds[1:] == ["-u", "-m", "rlhf_core.train.entry", "spec"]
        assert tr[1:3] == ["--nproc_per_node", "1"]
    else:
        assert (world, how) == (HERE, f"num_gpus all: {HERE} GPU(s) on this host x 1 node(s)")
        assert ds[0].endswith("deepspeed") and "--num_gpus" not in ds
        assert tr[1:3] == ["--nproc_per_node", "gpu"]
    assert launch.check_world(sft.Config(**base, num_gpus="all")) == world

    # a ring that cannot divide this host's world: refused at the launch, naming the size "all" resolved to
    uri, out = sft_data(tmp_path, 8), str(tmp_path / "ring")
    bad = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=uri, output_uri=out, num_gpus="all", packing_samples=True,
                     ring_attn_size=world + 1, train_batch_size=4 * world, micro_train_batch_size=4,
                     input_template=demo_task.INPUT_TEMPLATE, max_len=48)
    with pytest.raises(ValueError, match=re.escape(f"ring_attn_size {world + 1} does not divide the world size {world} "
                                                   f"({how})")):
        sft.run(bad)
    assert not store.committed_any(out)


def test_all_on_a_node_of_gpus_counts_them_for_the_checks_and_the_launchers(tmp_path, monkeypatch):
    """The count deepspeed's runner and torchrun take on a host of 4 GPUs (this test's stand-in for the device
    count: the command lines and checks are what is checked, nothing is launched): 4 per node, a hostfile's slots,
    and the refusals name the world they resolved."""
    monkeypatch.setattr(jobs, "gpus_here", lambda: 4)
    assert jobs.world_size("all", 2) == (8, "num_gpus all: 4 GPU(s) on this host x 2 node(s)")
    hosts = tmp_path / "hostfile"
    hosts.write_text("# the cluster\nnode-a slots=4\nnode-b slots=2  # a smaller one\nnode-c slots=8\n")
    assert jobs.hostfile_slots(str(hosts)) == [4, 2, 8]
    assert jobs.world_size("all", 2, str(hosts)) == (6, f"num_gpus all: the slots [4, 2] of {hosts}")
    assert jobs.world_size(3, 2, str(hosts)) == (6, "num_gpus x num_nodes")
    ds = jobs.launcher_command("m", ["s"], "deepspeed", "all", 2, str(hosts), 29500)
    assert ds[1:] == ["--master_port", "29500", "--hostfile", str(hosts), "--num_nodes", "2", "--module", "m", "s"]
    assert jobs.launcher_command("m", ["s"], "deepspeed", "all")[1] == "--master_port"  # one node: still every GPU
    tr = jobs.launcher_command("m", ["s"], "torchrun", "all", 2, master_port=29500, master_addr="h0")
    assert tr[1:5] == ["--nproc_per_node", "gpu", "--nnodes", "2"]
    assert jobs.procs_per_node("all") == 4 and jobs.procs_per_node(2) == 2
    base = dict(policy_uri="p", dataset_uri="d", output_uri="o", num_gpus="all", micro_train_batch_size=4)
    with pytest.raises(ValueError, match=r"train_batch_size 12 is not divisible by micro_train_batch_size x world size "
                                         r"\(4 x 4 = 16; num_gpus all: 4 GPU\(s\) on this host x 1 node\(s\)\)"):
        launch.check_world(sft.Config(**base, train_batch_size=12))
    with pytest.raises(ValueError, match=r"ds_tensor_parallel_size 4 does not divide the world size 6 "
                                         rf"\(num_gpus all: the slots \[4, 2\] of {hosts}\)"):
        launch.check_world(sft.Config(**base, train_batch_size=48, ds_tensor_parallel_size=4, num_nodes=2,
                                      hostfile=str(hosts)))
    assert launch.check_world(sft.Config(**base, train_batch_size=48, ring_attn_size=4, packing_samples=True)) == 4


def test_reference_stage_takes_all_and_runs_inline_on_one_device(tiny, tmp_path):
    """The reference pass's own num_gpus: all is one device here (no GPU, or one), so auto runs it inline."""
    m = reference.run(reference.Config(pairs_uri=pairs_data(tmp_path, 8), ref_uri=tiny.policy_uri, max_len=48,
                                       output_uri=str(tmp_path / "ref"), num_gpus="all"))
    assert m.metrics["launcher"] == ("inline" if HERE <= 1 else "deepspeed")
    assert store.read_table(m.uri).num_rows == 8
