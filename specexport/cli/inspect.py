"""specexport inspect OUTPUT_DIR: show a build's manifest in a readable form."""
from __future__ import annotations

import click

from specexport._console import console as make_console
from specexport.errors import SpecexportError
from specexport.manifest import file_problems, listed_files, read_manifest


@click.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
@click.option("--verify", is_flag=True,
              help="Recompute every file's sha256 against the manifest; exit 1 naming each file that differs.")
@click.option("-v", "--verbose", is_flag=True, help="Also list every tensor of the IO table.")
def inspect(output_dir, as_json, verify, verbose):
    """Describe the build in OUTPUT_DIR."""
    import json

    from rich.table import Table

    from specexport.cli.build import checks_table

    m = read_manifest(output_dir)
    console = make_console()
    if verify:
        _verify(output_dir, m)
        return
    if as_json:
        click.echo(json.dumps(m, indent=2))
        return
    console.print(f"[bold]{m['name']}[/]  schema {m['schema_version']}, built {m['created']} with specexport "
                  f"{m['specexport_version']}")
    console.print(f"max_seq_len {m['max_seq_len']}, verify up to {m['max_verify_tokens']} tokens, "
                  f"special tokens {m['special_tokens']}")
    console.print("versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()))
    table = Table()
    for col in ("model", "type", "layers", "vocab", "precision", "files", "size"):
        table.add_column(col)
    for role, mm in m["models"].items():
        io = mm["io"]
        for precision, e in mm["precisions"].items():
            table.add_row(role, mm["model_type"], str(io["num_layers"]), str(mm["vocab_size"]), precision,
                          "\n".join(e["files"]), f"{e['size_bytes'] / 2**20:.1f} MiB")
    for kind, h in m.get("heads", {}).items():
        if kind == "eagle":
            what = (f"EAGLE-{h['version']}" + (f", layers {h['aux_layers']}" if h["aux_layers"] else ""),
                    "1 layer", f"{h.get('draft_vocab') or m['models']['target']['vocab_size']}, top-{h['top_k']}")
        else:
            what = (f"{h['format']}, lm_head {h.get('lm_head', '?')}", f"{h['num_heads']} heads x {h['num_layers']}",
                    f"top-{h['top_k']}")
        for precision, e in h["precisions"].items():
            table.add_row(kind, *what, precision, "\n".join(e["files"]), f"{e['size_bytes'] / 2**20:.1f} MiB")
    console.print(table)
    from specexport.plugins import cpu

    cpu.offer(output_dir, m)                  # what a load would use: the engine's library, else one compiled here
    for arch, lib in (m.get("kernels") or {}).get("libraries", {}).items():
        console.print(f"kernels carried for {arch}: {m['kernels']['dir']}/{lib['file']} (kernel version "
                      f"{lib['kernel_version']}, paths {','.join(lib['paths'])}; compiled by {lib.get('compiler') or '?'})")
    for arch, why in (m.get("kernels") or {}).get("not_carried", {}).items():
        console.print(f"kernels not carried for {arch}: {why}")
    ours = False
    for role, mm in m["models"].items():
        for precision, e in mm["precisions"].items():
            line = cpu.describe(e)
            if line:
                ours = ours or line.startswith("CPU kernels: specexport's")
                console.print(f"{role} {precision}: {line}; rows {e.get('trees', '?')} (trees), min_tokens "
                              f"{e.get('min_tokens', '?')}")
    if ours:
        console.print(f"CPU kernels' self-check: {cpu.status().selfcheck}")
    for key, c in (m.get("pass_curve") or {}).items():        # stored by `specexport bench` (gamma.py)
        ms = {int(k): v for k, v in c["ms"].items()}
        here = "this CPU" if c.get("cpu") == cpu.tiers.cpu_id() else "another CPU"
        console.print(f"pass curve {key.split('/')[0]}: " + ", ".join(f"c({k}) {v:.1f} ms" + (f" ({v / ms[1]:.2f}x)" if k > 1
                      else "") for k, v in sorted(ms.items())) + f"; measured on {here}, {c.get('threads')} threads "
                      f"(sizes suffix and lookup rounds there: docs/methods.md)")
    console.print(checks_table(m, title="checks"))
    if verbose:
        for role, mm in m["models"].items():
            console.print(f"[bold]{role}[/] tensors:")
            for kind in ("inputs", "outputs"):
                for t in mm["io"][kind]:
                    console.print(f"  {kind[:-1]:6} {t['name']:22} {t['dtype']:8} {t['axes']}")


def _verify(output_dir, manifest) -> None:
    files = listed_files(manifest)
    problems = file_problems(output_dir, files, hashes=True)
    for line in problems:
        click.secho(line, fg="red", err=True)
    if problems:
        raise SpecexportError(f"{len(problems)} of {len(files)} files differ from the manifest of {output_dir}; "
                              f"rebuild with `specexport build --force`")
    click.echo(f"verified: {len(files)} files match the manifest's sha256 and sizes")
