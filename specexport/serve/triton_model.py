"""A Triton Inference Server Python-backend model that decodes with a specexport build.

`specexport export-triton` copies this file into a model repository as `<model>/1/model.py`, next to
a `config.pbtxt` that declares it decoupled (one request, many responses: the text streams) and
names the build in its parameters. It needs the specexport runtime (numpy, onnxruntime, tokenizers;
no torch) importable by the Python that Triton's Python backend runs. Each model instance (the
config's instance_group count) loads its own Pipeline and decodes one request at a time.

Inputs (one request = one sequence): text_input (BYTES [1]), and optional max_tokens (INT32),
temperature, top_p (FP32), top_k (INT32), seed (INT64), method (BYTES: vanilla | draft | lookup |
medusa | eagle | auto), stop (BYTES [-1]). Responses: one per decoded piece with text_output; the last one
(flagged final) has an empty text_output, finish_reason ("stop" | "length") and stats (JSON: method,
prompt and completion tokens, tokens per target pass, acceptance rate). A bad request gets one final
response carrying a TritonError.
"""
import json
from pathlib import Path

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        import specexport
        from specexport.runtime.methods import default_note

        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        build = Path(params["build"])
        if not build.is_absolute():
            build = Path(args["model_repository"]) / args["model_version"] / build
        threads = int(params["threads"]) if params.get("threads") else None
        self.pipe = specexport.load(build, precision=params.get("precision") or None,
                                    draft_precision=params.get("draft_precision") or None, threads=threads)
        self.method = params.get("method") or "auto"
        note = default_note(self.pipe.view(), self.method)
        pb_utils.Logger.log_info(f"specexport: {build} ({note})")

    def execute(self, requests):
        for request in requests:
            self._decode(request)
        return None                     # decoupled: every answer went through the response sender

    def _decode(self, request):
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            prompt = _text(request, "text_input")
            if prompt is None:
                raise ValueError("text_input: required (BYTES [1], the prompt)")
            method = _text(request, "method") or self.method
            ids = self.pipe.encode(prompt)
            pieces = self.pipe.stream(
                prompt_ids=ids, method=method, max_new_tokens=int(_scalar(request, "max_tokens", 16)),
                temperature=float(_scalar(request, "temperature", 0.0)), top_p=_scalar(request, "top_p", None),
                top_k=_scalar(request, "top_k", None), seed=_scalar(request, "seed", None), stop=_texts(request, "stop"))
            cancelled = getattr(request, "is_cancelled", lambda: False)
            for piece in pieces:
                if cancelled():
                    pieces.close()
                    sender.send(flags=final)
                    return
                sender.send(pb_utils.InferenceResponse(output_tensors=[_bytes("text_output", [piece])]))
            out = pieces.output
            stats = {"method": method, "prompt_tokens": len(ids), "completion_tokens": len(out.token_ids),
                     "tokens_per_target_pass": _finite(out.stats.mean_accepted_tokens),
                     "acceptance_rate": _finite(out.stats.acceptance_rate)}
            sender.send(pb_utils.InferenceResponse(output_tensors=[
                _bytes("text_output", [""]), _bytes("finish_reason", [out.finish_reason]),
                _bytes("stats", [json.dumps(stats)])]), flags=final)
        except Exception as err:        # the client's error (or ours): answered, and the model stays up
            sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(err))),
                        flags=final)

    def finalize(self):
        self.pipe.close()


def _tensor(request, name):
    t = pb_utils.get_input_tensor_by_name(request, name)
    return None if t is None else t.as_numpy().reshape(-1)


def _text(request, name):
    values = _tensor(request, name)
    if values is None or len(values) == 0:
        return None
    v = values[0]
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _texts(request, name):
    values = _tensor(request, name)
    return [] if values is None else [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values]


def _scalar(request, name, default):
    values = _tensor(request, name)
    return default if values is None or len(values) == 0 else values[0].item()


def _bytes(name, texts):
    return pb_utils.Tensor(name, np.array([t.encode("utf-8") for t in texts], dtype=np.object_))


def _finite(x):
    return None if x != x or x in (float("inf"), float("-inf")) else round(float(x), 4)
