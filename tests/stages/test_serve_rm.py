"""`rlhf-flows serve-rm`: a committed RM (or a plain HF folder) over HTTP, scored through by the score stage's
remote client; the rewards equal the in-process reward model's."""
import threading

import pytest
import requests

from rlhf_core.inputs import data
from rlhf_core import store
from rlhf_core.rollout.serve_rm import make_server
from stages import score

RESPONSES = [" great good .", " bad awful", " the tea was nice", " broken ."]


@pytest.fixture
def samples_uri(tmp_path):
    rows = [{"prompt": "Review of the tea:", "response": r, "sample_index": i} for i, r in enumerate(RESPONSES)]
    w = store.ArtifactWriter(str(tmp_path / "samples"), "generate", {"t": 1})
    w.begin()
    w.write_table("samples.parquet", data.to_table(rows, "samples"))
    return w.commit().uri


@pytest.mark.parametrize("model", ["reward_uri", "reward_dir"])
def test_score_through_serve_rm_equals_the_reward_model(tiny, samples_uri, tmp_path, model):
    server = make_server(str(getattr(tiny, model)), port=0, batch_size=3)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/get_reward"
    try:
        direct = score.run(score.Config(samples_uri=samples_uri, reward_model_uri=tiny.reward_uri, num_engines=0,
                                        output_uri=str(tmp_path / "direct")))
        remote = score.run(score.Config(samples_uri=samples_uri, remote_rm_url=url, batch_size=2,
                                        output_uri=str(tmp_path / "remote")))
        want = [r["reward"] for r in store.read_table(direct.uri).to_pylist()]
        got = [r["reward"] for r in store.read_table(remote.uri).to_pylist()]
        assert got == pytest.approx(want, abs=1e-5) and len(set(got)) == 4
        bad = requests.post(url, json={"query": "not a list"}, timeout=10)
        assert bad.status_code == 400 and "'query' must be a list" in bad.json()["error"]
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)


def test_serve_rm_without_normalisation_returns_raw_scores(tiny):
    from rlhf_core.rollout.rewards import RewardSpec
    from rlhf_core.rollout.reward_model import RMEngine

    server = make_server(str(tiny.reward_dir), port=0, normalize=False)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        got = requests.post(url, json={"query": ["Review of the tea: great"]}, timeout=10).json()["rewards"]
        raw = RMEngine(str(tiny.reward_dir), RewardSpec(model=str(tiny.reward_dir), normalize=False)).score(
            [("Review of the tea: great", "")])
        assert got == pytest.approx(raw)
    finally:
        server.shutdown()
        server.server_close()
        t.join(5)
