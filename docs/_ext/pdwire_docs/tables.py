"""Directives that put the code's own tables on the site, rendered by ``pdwire.spectables`` at
build time: field tables, statuses, error codes and strings, negotiation and transitions."""

from __future__ import annotations

from docutils import nodes

from pdwire import spectables

from .coverage import MESSAGE_ATTR
from .markdown import MarkdownDirective

MACHINES = ("transfer", "load")


class Fields(MarkdownDirective):
    """The field table of one message or HTTP document, tagged with its name for the coverage
    check."""

    required_arguments = 1

    def markdown(self) -> str:
        name = self.arguments[0]
        if name not in spectables.SENDERS:
            raise self.error(f"unknown message or document {name!r}")
        return spectables.field_table(name)

    def run(self) -> list[nodes.Node]:
        out = super().run()
        for node in out:
            for table in node.findall(nodes.table):
                table[MESSAGE_ATTR] = self.arguments[0]
        return out


class Transitions(MarkdownDirective):
    """The transition table of ``transfer`` (P) or ``load`` (D)."""

    required_arguments = 1

    def markdown(self) -> str:
        if self.arguments[0] not in MACHINES:
            raise self.error(f"unknown state machine {self.arguments[0]!r}; one of {MACHINES}")
        return spectables.transition_table(self.arguments[0])


class Negotiation(MarkdownDirective):
    def markdown(self) -> str:
        return spectables.negotiation_table()


class Statuses(MarkdownDirective):
    def markdown(self) -> str:
        return spectables.status_table()


class ErrorCodes(MarkdownDirective):
    def markdown(self) -> str:
        return spectables.error_code_table()


class ErrorStrings(MarkdownDirective):
    def markdown(self) -> str:
        return spectables.error_string_table()
