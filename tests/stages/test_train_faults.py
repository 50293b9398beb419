"""Training that survives its own final-upload failure: the S3 endpoint goes down in the middle of the model
upload (a TCP cut in front of the real moto endpoint, which keeps its data, like an S3 outage), comes back,
and the rerun commits the model trained the first time without retraining. No partial artifact is read."""
import logging
import socket
import threading

import pytest

from rlhf_core.inputs import model_inputs
from rlhf_core import store
from stages import sft
from tests.stages.test_sft import FAST, sft_data, weights


class Cut:
    """A TCP proxy to the moto endpoint that can be cut (connections refused and reset) and restored."""

    def __init__(self, target_port: int):
        self.target, self.conns, self.lsock = target_port, [], None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.up()

    def up(self):
        self.lsock = socket.socket()
        self.lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.lsock.bind(("127.0.0.1", self.port))
        self.lsock.listen(32)
        threading.Thread(target=self._accept, args=(self.lsock,), daemon=True).start()

    def down(self):
        self.lsock.close()
        for c in self.conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self.conns = []

    def _accept(self, lsock):
        while True:
            try:
                client, _ = lsock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            self.conns += [client, server]
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.mark.slow
def test_endpoint_down_mid_model_upload_then_rerun_commits_without_retraining(tiny, moto_s3, tmp_path, monkeypatch,
                                                                            caplog):
    monkeypatch.setenv("RLHF_FLOWS_CACHE", str(tmp_path / "cache"))
    cut = Cut(moto_s3.port)
    so = {"endpoint_url": f"http://127.0.0.1:{cut.port}"}
    out = f"s3://{moto_s3.bucket}/upload-fault-{tmp_path.name}"
    cfg = sft.Config(policy_uri=tiny.policy_uri, dataset_uri=sft_data(tmp_path), output_uri=out, storage_options=so,
                     upload_retries=1, **FAST)
    record, uploaded = store.ArtifactWriter._record, []

    def cut_after_two_files(self, rel):  # the endpoint dies after 2 files of the model folder went up
        record(self, rel)
        uploaded.append(rel)
        if len(uploaded) == 2:
            cut.down()

    monkeypatch.setattr(store.ArtifactWriter, "_record", cut_after_two_files)
    with pytest.raises(store.ArtifactError, match=r"upload of the trained model to .* failed 2 times .*the model is "
                                                  r"kept in .*cache/jobs/\w+: rerun to commit it without retraining"):
        sft.run(cfg)
    monkeypatch.setattr(store.ArtifactWriter, "_record", record)
    work = next((tmp_path / "cache" / "jobs").iterdir())
    trained = weights(work / "model")
    assert not (work / "spec.json").exists()  # the job's spec is removed when it exits
    cut.up()
    fs, path = store.filesystem(out)
    assert len(fs.ls(path)) >= 2  # the partial upload is there ...
    with pytest.raises(store.NotCommittedError, match="has files but no _MANIFEST.json"):
        store.read_manifest(out, storage_options=so)  # ... and is never read as an artifact
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="rlhf_flows"):
        m = sft.run(cfg)
    assert "reusing the model trained for" in caplog.text and "launching:" not in caplog.text
    assert m.metrics["steps_done"] == m.metrics["planned_steps"] == 6
    local = model_inputs.fetch_model(out, so)
    assert all((weights(local)[k] == v).all() for k, v in trained.items())
    assert not work.exists()  # cleaned after the commit


def test_a_finished_job_is_reused_with_a_full_model_or_an_adapter_only(tmp_path):
    """After a failed upload the rerun reuses the trained job: a saved model (config.json) or, with
    lora_merge=false, a saved adapter counts; a job that stopped early or saved nothing does not."""
    import json

    from rlhf_core.train.launch import _finished

    (tmp_path / "result.json").write_text(json.dumps({"steps_done": 4, "planned_steps": 4}))
    assert _finished(tmp_path) is None  # nothing saved
    (tmp_path / "model" / "adapter").mkdir(parents=True)
    (tmp_path / "model" / "adapter" / "adapter_config.json").write_text("{}")
    assert _finished(tmp_path)["steps_done"] == 4
    (tmp_path / "result.json").write_text(json.dumps({"steps_done": 3, "planned_steps": 4}))
    assert _finished(tmp_path) is None
