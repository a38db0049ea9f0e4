"""The `fisherlens` command line. Command modules live in `app/commands/`, one per area; the job
commands are one per registered kind (app/commands/kinds.py).

Nothing here imports torch at start-up: compute is imported inside the commands that need it,
so `fisherlens status`, `submit` and the web app stay light.
"""

from __future__ import annotations

import click

from app.commands import doctor, experiments, fisher, jobs, training, users, zoo
from app.commands.kinds import kind_commands


class _Main(click.Group):
    """The CLI turns the HTTP client's typed errors (app.client.ClientError) into one line on
    stderr and its exit status: the only place a client answer becomes an exit."""

    def invoke(self, ctx: click.Context) -> object:
        from app.client import ClientError

        try:
            return super().invoke(ctx)
        except ClientError as exc:
            click.echo(f"error: {exc}", err=True)
            raise SystemExit(exc.code) from None


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fisherlens")
def main() -> None:
    """fisherlens: explore LLM post-training update sparsity through the diagonal model Fisher."""


# one command per registered job kind (its own report where a kind has one, else generic)
for command in kind_commands([*fisher.commands, *experiments.commands, *training.commands]):
    main.add_command(command)
for module in (zoo, jobs, users, doctor):
    for command in module.commands:
        main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
