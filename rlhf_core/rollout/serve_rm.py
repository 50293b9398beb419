"""`rlhf-flows serve-rm MODEL`: a reward model over HTTP, the counterpart of the score stage's `remote_rm_url`
(OpenRLHF's serve_rm request shape):

    POST /  (any path)  {"query": ["prompt+response", ...], "prompts": [...], "labels": [...]}
                     -> {"rewards": [float, ...], "scores": [float, ...]}

MODEL is a committed reward-model artifact or a plain HF folder. Queries are scored as given (the client
already joined prompt and response), batched by length on one RMEngine, cut to `max_len` tokens, and
normalised by the model's reward_mean/reward_std unless `normalize` is off. A bad request gets a 400 with
a JSON {"error": ...}; the server answers one request at a time (one model, no concurrent forwards).
"""
from __future__ import annotations

import json
import logging
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

log = logging.getLogger("rlhf_flows")


def make_server(model: str, host: str = "127.0.0.1", port: int = 5000, batch_size: int = 64, max_len: int = 2048,
                normalize: bool = True, value_head_prefix: str = "value_head", storage_options: dict | None = None
                ) -> HTTPServer:
    from rlhf_core.rollout.generation import model_input
    from rlhf_core.rollout.rewards import RewardSpec, check_finite
    from rlhf_core.rollout.reward_model import RMEngine

    local, _ = model_input(model, storage_options)
    spec = RewardSpec(model=str(local), normalize=normalize, max_len=max_len, batch_size=batch_size,
                      value_head_prefix=value_head_prefix, storage_options=storage_options or {})
    engine = RMEngine(str(local), spec)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's naming)
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                queries = body.get("query")
                if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
                    raise ValueError("'query' must be a list of strings (prompt + response)")
            except ValueError as e:
                return self._send(400, {"error": str(e)})
            rewards = engine.score([(q, "") for q in queries])
            check_finite(rewards, f"reward model {model}")
            self._send(200, {"rewards": rewards, "scores": rewards})

        def _send(self, code: int, obj: dict) -> None:
            out = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, fmt, *args):  # one line per request on the rlhf_flows logger, not stderr
            log.info("serve-rm %s", fmt % args)

    return HTTPServer((host, port), Handler)


def serve(model: str, host: str = "127.0.0.1", port: int = 5000, **kw) -> int:
    server = make_server(model, host, port, **kw)
    print(f"serving reward model {model} on http://{host}:{server.server_address[1]}/ (Ctrl-C stops)", file=sys.stderr,
          flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
