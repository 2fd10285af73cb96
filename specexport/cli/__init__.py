"""`specexport` command line. `main(argv)` returns the exit code, so tests call it in-process.

Exit codes: 0 ok; 1 a user error (one line, `-v` adds the traceback); 2 a failed parity gate.
Anything else is a bug and shows its traceback.
"""
from __future__ import annotations

import sys
import traceback

import click

from specexport import __version__
from specexport.errors import ParityError, SpecexportError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="specexport")
def cli():
    """Export Hugging Face checkpoints for speculative decoding and run them."""


def _register() -> None:
    """The subcommands, listed here (each module only defines its command: no import back into this one)."""
    from specexport.cli import bench, build, distill, generate, heads, inspect, serve

    for command in (bench.bench, build.build, distill.distill_draft, generate.generate, heads.train_heads, inspect.inspect, serve.serve, serve.export_triton):
        cli.add_command(command)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in argv)
    try:
        cli.main(args=argv, prog_name="specexport", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.exceptions.ClickException as err:      # usage errors: click formats them
        err.show()
        return 1                                         # 2 is reserved for a failed parity gate
    except click.exceptions.Exit as err:
        return err.exit_code
    except SpecexportError as err:
        if verbose:
            traceback.print_exc()
        click.secho(f"error: {err}", fg="red", err=True)
        return 2 if isinstance(err, ParityError) else 1
    return 0


def entry_point() -> None:     # [project.scripts]
    sys.exit(main())


_register()
