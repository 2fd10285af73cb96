"""specexport inspect OUTPUT_DIR: show a build's manifest in a readable form."""
from __future__ import annotations

import click

from specexport.cli import cli


@cli.command()
@click.argument("output_dir", type=click.Path(file_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the raw manifest.")
@click.option("-v", "--verbose", is_flag=True, help="Also list every tensor of the IO table.")
def inspect(output_dir, as_json, verbose):
    """Describe the build in OUTPUT_DIR."""
    import json

    from rich.console import Console
    from rich.table import Table

    from specexport.cli.build import checks_table
    from specexport.manifest import read_manifest

    m = read_manifest(output_dir)
    console = Console()
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
    console.print(table)
    console.print(checks_table(m, title="checks"))
    if verbose:
        for role, mm in m["models"].items():
            console.print(f"[bold]{role}[/] tensors:")
            for kind in ("inputs", "outputs"):
                for t in mm["io"][kind]:
                    console.print(f"  {kind[:-1]:6} {t['name']:22} {t['dtype']:8} {t['axes']}")
