"""CLI commands (filled in by the owning area)."""

from __future__ import annotations

import click

commands: list[click.Command] = []
