"""Our importance-weighted int4 against llama.cpp's own on the same checkpoint and the same calibration text:
`llama-imatrix` then `llama-quantize --imatrix` to the int4 mix's type (Q4_K_M, Q4_1, Q4_0), beside our build's
`importance: imatrix` file.

    python benchmarks/build_llama_cpp.py       # llama-imatrix, llama-quantize and the sources' converter
    pip install sentencepiece                  # the converter imports it (for a llama vocabulary) even for BPE
    specexport build model.yaml --no-bench     # precisions [fp32, int4], int4 {scheme: blocks, importance:
                                               # imatrix}, calibration_text and eval_text set
    python benchmarks/imatrix_vs_llama.py ENGINE --llama-cpp DIR [--eval-sequences 16]

The checkpoint goes to an F32 GGUF by llama.cpp's convert_hf_to_gguf.py; llama-imatrix reads the build's
calibration_text in chunks of the build's length (128 tokens, as many chunks as the build took); each GGUF
(ours with and llama's with and without the imatrix) is run by our int4 graph, its block constants
swapped for the file's (the same kernels and graph), and measured against the fp32 graph on eval_text (top-1 with near-ties, mean KL), and
its tensors compared with ours byte for byte.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from specexport.builder.stages.quantize import CALIBRATION_SEQUENCES
from specexport.io_spec import ModelIO
from specexport.quant.gguf_graph import gguf_tensors
from specexport.quant.quality import EVAL_LENGTH, measure_quality, runtime_session, text_sequences


LLAMA_FTYPE = {"q4_k_m": "Q4_K_M", "q4_1": "Q4_1", "q4_0": "Q4_0"}     # our int4 mix -> llama-quantize's type


def run(cmd) -> None:
    print("+", " ".join(map(str, cmd)), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{Path(cmd[1 if cmd[0] == sys.executable else 0]).name} failed ({done.returncode}): "
                 f"{done.stderr.strip()[-800:]}")


def tensors(path: Path) -> dict:
    import gguf

    return {t.name: (t.tensor_type.name, bytes(t.data.tobytes())) for t in gguf.GGUFReader(str(path)).tensors}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engine", type=Path)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the folder with llama-imatrix and llama-quantize")
    ap.add_argument("--eval-sequences", type=int, default=16, help="chunks of eval_text measured (128 tokens each)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    manifest = json.loads((args.engine / "manifest.json").read_text())
    cfg, target = manifest["config"], manifest["models"]["target"]
    int4 = target["precisions"]["int4"]
    if int4["quantization"].get("importance", {}) in (None, "none") or not cfg.get("calibration_text"):
        sys.exit(f"{args.engine}: int4 must be built with importance: imatrix and a calibration_text")
    hf_dir, ours = Path(cfg["target"]["path"]), args.engine / int4["gguf_file"]["path"]
    ftype = LLAMA_FTYPE[int4["quantization"]["mix"]]
    fp32_graph = args.engine / target["precisions"]["fp32"]["dir"] / "model.onnx"
    int4_graph = args.engine / int4["dir"] / "model.onnx"
    io = ModelIO.from_dict(target["io"])
    hf_config = json.loads((hf_dir / "config.json").read_text())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf_dir)
    bos = tok.bos_token_id if getattr(tok, "add_bos_token", False) else None
    ids = tok(Path(cfg["eval_text"]).read_text(), add_special_tokens=False)["input_ids"]
    sequences = text_sequences(ids, bos=bos, length=EVAL_LENGTH, count=args.eval_sequences)
    src = args.llama_cpp.parent / "src"
    with tempfile.TemporaryDirectory(prefix="imatrix-vs-llama-") as tmp:
        tmp = Path(tmp)
        f32, imx = tmp / "f32.gguf", tmp / "imatrix.gguf"
        run([sys.executable, src / "convert_hf_to_gguf.py", hf_dir, "--outtype", "f32", "--outfile", f32])
        run([args.llama_cpp / "llama-imatrix", "-m", f32, "-f", cfg["calibration_text"], "-c", str(EVAL_LENGTH),
             "--chunks", str(CALIBRATION_SEQUENCES), "-t", str(args.threads), "-o", imx])
        files = {"ours, imatrix": ours}
        for name, extra in (("llama-quantize, imatrix", ["--imatrix", imx]), ("llama-quantize, none", [])):
            files[name] = tmp / f"llama-quantize-{name.split(', ')[1]}.gguf"
            run([args.llama_cpp / "llama-quantize", *extra, f32, files[name], ftype, str(args.threads)])
        mine = tensors(ours)
        reference = runtime_session(fp32_graph)
        print(f"{args.engine}: eval_text {cfg['eval_text']} ({len(sequences)} sequences of <= {EVAL_LENGTH}), "
              f"calibration_text {cfg['calibration_text']} ({CALIBRATION_SEQUENCES} x {EVAL_LENGTH} tokens)")
        print("| file | tensors equal to ours | top-1 vs fp32 | mean KL |")
        print("|---|---|---|---|")
        for k, (name, path) in enumerate(files.items()):
            theirs = tensors(path)
            same = sum(1 for t, v in theirs.items() if mine.get(t) == v)
            graph = with_blocks_of(int4_graph, path, hf_config, tmp / f"graph-{k}")
            q = measure_quality(reference, runtime_session(graph), io, sequences=sequences)
            print(f"| {name} | {same} / {len(theirs)} | {q.top1_agreement:.4f} | {q.mean_kl:.4f} |", flush=True)


def with_blocks_of(graph: Path, gguf_path: Path, hf_config: dict, folder: Path) -> Path:
    """A copy of our int4 graph (in `folder`) whose block constants are `gguf_path`'s tensors (rows in the
    graph's order, as the build reads them): the same graph and kernels on the other file's bytes. The types
    must match tensor for tensor (both files the same mix)."""
    import onnx
    from onnx import numpy_helper

    raws = {name: raw for name, _, _, raw in gguf_tensors(gguf_path, hf_config, raw=True) if raw is not None}
    model = onnx.load(str(graph))
    for i, init in enumerate(model.graph.initializer):
        if init.name.endswith(".blocks"):
            raw = raws[init.name.removesuffix(".blocks")].raw
            if tuple(raw.shape) != tuple(init.dims):
                sys.exit(f"{gguf_path.name}: {init.name} is {raw.shape}, our graph's {tuple(init.dims)} (another type)")
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(raw, init.name))
    folder.mkdir()
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx.data")
    return folder / "model.onnx"


if __name__ == "__main__":
    main()
