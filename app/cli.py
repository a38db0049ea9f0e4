"""The `fisherlens` command line. Command modules live in `app/commands/`, one per area.

Nothing here imports torch at start-up: compute is imported inside the commands that need it,
so `fisherlens status`, `submit` and the web app stay light.
"""

from __future__ import annotations

import click

from app.commands import doctor, experiments, fisher, jobs, training, users, zoo


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="fisherlens")
def main() -> None:
    """fisherlens: explore LLM post-training update sparsity through the diagonal model Fisher."""


for module in (zoo, fisher, experiments, training, jobs, users, doctor):
    for command in module.commands:
        main.add_command(command)


if __name__ == "__main__":  # pragma: no cover
    main()
