"""`rlhf-flows show` lists kept versions; `rlhf-flows gc URI --keep N` is the only thing that deletes them;
`rlhf-flows gc --cache-max-gb X` shrinks this machine's model cache, least recently used entries first."""
import json
import os
import time

from flows.cli import main
from rlhf_core.inputs import model_inputs
from rlhf_core import store
from rlhf_core.store import versions


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


def _tree_bytes(d):
    return sum(p.stat().st_size for p in d.rglob("*") if p.is_file())


def test_gc_cache_max_gb_drops_least_recently_used_cache_entries(s3_root, tmp_path, monkeypatch, capsys):
    """Three cached artifacts last used 3, 2 and 1 days ago; a fetch then uses the oldest again. With a limit
    that holds one entry, the two least recently used go and the one just used stays; a temp dir written to
    2 hours ago (a killed download) goes, one written to now (a download in progress) stays; fetch_model
    then downloads a removed entry again."""
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    arts = [_commit(f"{s3_root}/m{i}", n) for i, n in enumerate((300, 200, 100))]
    dirs = [model_inputs.fetch_model(a.uri) for a in arts]
    now = time.time()
    for d, days in zip(dirs, (3, 2, 1)):
        os.utime(d / store.MANIFEST, (now - days * 86400,) * 2)
    assert model_inputs.fetch_model(arts[0].uri) == dirs[0]  # a cache hit marks the entry used
    assert time.time() - (dirs[0] / store.MANIFEST).stat().st_mtime < 60
    cache = tmp_path / "cache" / "models"
    dead, busy = cache / ".dead-x1", cache / ".busy-x2"
    for t, when in ((dead, now - 7200), (busy, now)):
        t.mkdir()
        (t / "part").write_bytes(b"p" * 10)
        os.utime(t / "part", (when, when))
        os.utime(t, (when, when))
    limit = _tree_bytes(dirs[0]) + _tree_bytes(busy) + 1  # less than any two entries
    assert limit < _tree_bytes(dirs[0]) + _tree_bytes(dirs[2])
    freed = _tree_bytes(dead) + _tree_bytes(dirs[1]) + _tree_bytes(dirs[2])
    capsys.readouterr()
    assert main(["gc", "--cache-max-gb", str(limit / 1e9)]) == 0
    out = capsys.readouterr().out
    assert [line.split(" (")[0] for line in out.splitlines()[:3]] == [f"removed {dead}", f"removed {dirs[1]}",
                                                                     f"removed {dirs[2]}"]
    assert f"3 entries removed, {freed / 1e3:.2f} kB freed" in out and f"limit {limit / 1e9:g} GB" in out, out
    assert dirs[0].is_dir() and busy.is_dir() and not dead.exists()
    assert not dirs[1].exists() and not dirs[2].exists() and not list(cache.glob(".*-gc-*"))
    again = model_inputs.fetch_model(arts[2].uri)
    assert again == dirs[2] and json.loads((again / "rows.json").read_text()) == list(range(100))
    assert main(["gc"]) == 2 and "gc needs URI --keep N" in capsys.readouterr().err
    assert main(["gc", "--keep", "2"]) == 2 and "--keep N needs a URI" in capsys.readouterr().err
