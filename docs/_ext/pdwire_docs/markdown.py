"""A directive base that writes Markdown and has it parsed where the directive stands."""

from __future__ import annotations

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.util.docutils import SphinxDirective


class MarkdownDirective(SphinxDirective):
    """Subclasses return Markdown from ``markdown``; it is parsed as MyST in place."""

    def markdown(self) -> str:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        return self.parse(self.markdown())

    def parse(self, markdown: str) -> list[nodes.Node]:
        source, _ = self.get_source_info()
        container = nodes.container()
        lines = StringList(markdown.splitlines(), source=source)
        self.state.nested_parse(lines, self.content_offset, container)
        return list(container.children)
