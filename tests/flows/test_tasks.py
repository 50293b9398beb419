"""The Prefect layer over a stage: its cache is used, but never trusted over the store."""
import json

import pytest

from rlhf_core import store
from rlhf_core.store import versions
from stages import prepare
from flows.tasks import run_stage, task_for


@pytest.fixture
def source(tmp_path):
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"input": f"q{i}"}) + "\n" for i in range(6)))
    committed = str(tmp_path / "src")
    prepare.run(prepare.Config(kind="prompts", data=str(src), output_uri=committed))  # committed input: cacheable
    return committed


def _flow(source, out):
    from prefect import flow

    @flow
    def prep(n: int) -> dict:
        return run_stage(task_for("prepare"), prepare.Config(kind="prompts", data=source, input_key="prompt", max_samples=n,
                                                 output_uri=out))
    return prep


def test_cache_hit_is_used_while_the_artifact_is_there_and_refused_once_deleted(prefect_harness, source, tmp_path):
    out = str(tmp_path / "out")
    prep = _flow(source, out)
    first = prep(3)
    state = prep(3, return_state=True)
    assert state.name == "Completed" and state.result()["created_at"] == first["created_at"]
    fs, path = store.filesystem(out)
    fs.rm(path, recursive=True)  # the artifact is gone: a cache hit would point at nothing
    again = prep(3)
    assert store.read_manifest(out).created_at == again["created_at"] != first["created_at"]


def test_stale_cache_record_for_a_rewritten_artifact_is_not_trusted(prefect_harness, source, tmp_path):
    out = str(tmp_path / "out")
    prep = _flow(source, out)
    three = prep(3)
    four = prep(4)
    assert four["rows"] == 4  # the same prefix now holds another artifact; n=3's is kept under _versions/
    back = prep(3)  # reverted: the kept artifact comes back, the very one Prefect's record names
    assert (back["fingerprint"], back["created_at"]) == (three["fingerprint"], three["created_at"])
    assert prep(4)["created_at"] == four["created_at"]
    versions.prune_versions(out, keep=1)  # n=3's version is gone: Prefect's record for it now names nothing
    back = prep(3)
    held = store.read_manifest(out)
    assert back["rows"] == held.rows == 3 and back["fingerprint"] == held.fingerprint == three["fingerprint"]
    assert held.created_at == back["created_at"] != three["created_at"]


def test_cache_key_follows_the_stage_module_source_and_the_package_source(tmp_path, monkeypatch):
    """The landed key hashed the generic task wrapper, the same for every stage: editing a stage's code
    invalidated nothing."""
    import importlib
    import shutil
    import sys
    from types import SimpleNamespace

    from flows import tasks as common

    for name, body in (("stage_a", "return 1"), ("stage_b", "return 2")):
        (tmp_path / f"{name}.py").write_text(f"def run(cfg):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = prepare.Config(kind="prompts", data="x.jsonl", output_uri=str(tmp_path / "o"))
    keys = [common._cache_key(SimpleNamespace(task=common.stage_task("same", importlib.import_module(m).run)),
                              {"cfg": cfg}) for m in ("stage_a", "stage_b")]
    assert keys[0] != keys[1]
    sys.modules.pop("stage_a"), sys.modules.pop("stage_b")

    root = tmp_path / "copy"
    for pkg in common.PACKAGES:
        shutil.copytree(f"{common.Path(common.__file__).resolve().parents[1]}/{pkg}", root / pkg)
    before = common.source_version(str(root))
    with open(root / "rlhf_core" / "rl" / "losses.py", "a") as f:
        f.write("\n# an edit in a helper the stage calls\n")
    assert common.source_version.__wrapped__(str(root)) != before
