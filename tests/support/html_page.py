"""An HTML page as the report tests read it (standard library parser only)."""

from __future__ import annotations

import html.parser


class Page(html.parser.HTMLParser):
    """The parts of a report page the tests look at: tags seen, the sample table's rows (attributes
    and cell texts) and every attribute that could make a browser fetch."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.rows: list[tuple[dict, list[str]]] = []
        self.texts: dict[str, str] = {}
        self._cell: list[str] | None = None
        self._in_body = False
        self._id: str | None = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append((tag, attrs))
        if tag == "tbody":
            self._in_body = True
        elif tag == "tr" and self._in_body:
            self.rows.append((attrs, []))
        elif tag == "td" and self._in_body:
            self._cell = []
        elif tag == "br" and self._cell is not None:
            self._cell.append("\n")
        if attrs.get("id"):
            self._id = attrs["id"]
            self.texts[self._id] = ""

    def handle_endtag(self, tag):
        if tag == "tbody":
            self._in_body = False
        elif tag == "td" and self._cell is not None:
            self.rows[-1][1].append("".join(self._cell))
            self._cell = None
        self._id = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        if self._id is not None:
            self.texts[self._id] += data

    def count(self, tag: str, **attrs) -> int:
        return sum(1 for t, a in self.tags if t == tag and all(a.get(k) == v for k, v in attrs.items()))
