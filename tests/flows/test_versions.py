"""`rlhf-flows show` lists kept versions; `rlhf-flows gc URI --keep N` is the only thing that deletes them."""
from flows.cli import main
from rlhf_core import store, versions


def _commit(uri, n, inputs=None):
    w = store.ArtifactWriter(uri, "prepare", {"n": n}, inputs)
    w.begin()
    w.write_json("rows.json", list(range(n)))
    return w.commit()


def test_show_lists_versions_and_gc_prunes_only_when_asked(tmp_path, capsys):
    run = str(tmp_path / "run")
    first = _commit(f"{run}/a", 1)
    down = _commit(f"{run}/b", 0, {"a": first})
    second = _commit(f"{run}/a", 2)
    _commit(f"{run}/a", 3)
    capsys.readouterr()
    assert main(["show", f"{run}/a"]) == 0
    text = capsys.readouterr().out
    assert f"version    {second.fingerprint} {run}/a/_versions/{second.fingerprint}" in text
    assert f"version    {first.fingerprint}" in text
    assert main(["show", f"{run}/b"]) == 0  # b's lineage still resolves the version of a it used
    assert f"prepare {first.fingerprint} {run}/a (" in capsys.readouterr().out
    assert main(["show", run]) == 0
    text = capsys.readouterr().out
    assert "_versions" not in text.split("previous")[0] and f"previous {first.fingerprint}" in text
    assert main(["gc", run, "--keep", "0"]) == 2 and "keep must be >= 1" in capsys.readouterr().err
    assert len(versions.versions(f"{run}/a")) == 2  # nothing deleted before gc
    assert main(["gc", run, "--keep", "2"]) == 0
    assert f"removed {run}/a/_versions/{first.fingerprint}" in capsys.readouterr().out
    assert [v.fingerprint for v in versions.versions(f"{run}/a")] == [second.fingerprint]
    assert store.read_manifest(f"{run}/b").fingerprint == down.fingerprint
