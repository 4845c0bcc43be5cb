"""`tpumk export`, `tpumk cache-key`, `tpumk inspect`: click commands over tpumk.artifacts.

Register them on the main group (tpumk/cli.py, after the other commands):

    from tpumk.cli_export import cache_key, export, inspect
    main.add_command(export)
    main.add_command(cache_key)
    main.add_command(inspect)
"""

from __future__ import annotations

import click

from tpumk.cli_options import emit_json, fail_cleanly, build_options, resolve_build_inputs


@click.command()
@build_options
@click.option("--out", "out_dir", default="artifacts", show_default=True, type=click.Path(),
              help="Artifact root: OUT/<model>/<target>/<key>/.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def export(model, checkpoint, dtype, target, batch, context, q_len, page_size, tuning_file, out_dir, as_json):
    """Compile the decode step and write it as a content-addressed artifact (cache hit: no compile)."""
    from tpumk.artifacts import export as do_export

    cfg, tgt, tuning = resolve_build_inputs(model, checkpoint, dtype, target, tuning_file)
    r = do_export(cfg, tgt, batch=batch, context=context, tuning=tuning, q_len=q_len, page_size=page_size,
                  out_dir=out_dir)
    if as_json:
        emit_json(r.to_dict())
        return
    what = "cache hit, nothing compiled" if r.cache_hit else f"exported in {r.seconds:.2f} s"
    click.echo(f"{r.path} ({what})")
    for name in ("executable", "exported"):
        click.echo(f"  {name}: {r.manifest['target'].get(name, 'n/a')}")


@click.command("cache-key")
@build_options
@click.option("--json", "as_json", is_flag=True, help="Print the key and everything it covers.")
@fail_cleanly
def cache_key(model, checkpoint, dtype, target, batch, context, q_len, page_size, tuning_file, as_json):
    """Print the build's cache key (no compile)."""
    from tpumk.cache_key import cache_key as key_of, key_inputs

    cfg, tgt, tuning = resolve_build_inputs(model, checkpoint, dtype, target, tuning_file)
    inputs = key_inputs(cfg, tgt, batch, context, q_len, page_size, tuning)
    if as_json:
        emit_json({"key": key_of(inputs), "inputs": inputs})
    else:
        click.echo(key_of(inputs))


@click.command()
@click.argument("path", type=click.Path())
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@fail_cleanly
def inspect(path, as_json):
    """Show an artifact's manifest summary and verify its files and versions."""
    from tpumk.artifacts import inspect as do_inspect

    info = do_inspect(path)
    if as_json:
        emit_json(info)
    else:
        click.echo(f"{info['path']}")
        for k in ("key", "model", "target", "shapes", "versions"):
            if k in info:
                click.echo(f"  {k}: {info[k]}")
        click.echo("  valid" if info["valid"] else f"  INVALID: {info['problem']}")
    if not info["valid"]:
        raise SystemExit(1)
