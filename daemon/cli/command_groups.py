"""The top-level command group of `trainerd` and `trainerctl`."""

from __future__ import annotations

import click


class PointingGroup(click.Group):
    """An unknown command that one of this group's subgroups holds is pointed there: `trainerctl drain n1`
    says "Did you mean 'trainerctl nodes drain'?", `trainerd init` "Did you mean 'trainerd certs init'?"."""

    def resolve_command(self, ctx: click.Context, args: list[str]) -> tuple[str | None, click.Command | None,
                                                                             list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as exc:
            name = args[0] if args else ""
            homes = [group_name for group_name, group in sorted(self.commands.items())
                     if isinstance(group, click.Group) and name in group.commands]
            if not homes:
                raise
            raise click.UsageError(f"{exc.message} Did you mean '{ctx.command_path} {homes[0]} {name}'?",
                                   ctx) from None
