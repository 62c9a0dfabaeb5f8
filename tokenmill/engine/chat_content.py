"""How a chat template wants a message's content (vLLM's --chat-template-content-format):

- "string": the text itself (text parts joined by newlines): most templates print
  `message['content']`;
- "openai": a list of parts, [{"type": "text", "text": ...}] (a plain string wrapped as one
  part): templates written for multimodal messages loop `for part in message['content']`,
  and given a string they would loop over its characters;
- "auto" (the default): "openai" when the template loops over a message's content, read from
  its Jinja syntax tree as vLLM reads it (a loop over `messages` binds a message; a loop over
  that message's `content`, or over a variable assigned from it, means parts), else "string".
"""

from __future__ import annotations

import functools
import logging
from typing import Any

logger = logging.getLogger(__name__)

CONTENT_FORMATS = ("auto", "string", "openai")


def checked_format(asked: str) -> str:
    if asked not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of "
                         f"{', '.join(CONTENT_FORMATS)}, got {asked!r}")
    return asked


def content_format(template: str, asked: str = "auto") -> str:
    """"string" or "openai" for `template`, as `asked` ("auto": detected)."""
    return _detected(template) if checked_format(asked) == "auto" else asked


def as_content(content: Any, fmt: str) -> Any:
    """A message's content (None, a string or a list of text parts as dicts) in `fmt`."""
    if content is None:
        return None
    if fmt == "openai":
        return [{"type": "text", "text": content}] if isinstance(content, str) else content
    if isinstance(content, list):
        if not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in content):
            raise ValueError("a message's content parts must be text parts "
                             '({"type": "text", "text": ...})')
        return "\n".join(part["text"] for part in content)
    return content


@functools.lru_cache(maxsize=32)
def _detected(template: str) -> str:
    import jinja2
    from jinja2 import nodes

    try:
        tree = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateSyntaxError as e:  # rendering will say so; the common default
        logger.warning("chat template not parsed for its content format (%s): string", e)
        return "string"
    messages = _bound_to(tree, "messages", nodes)
    loops = list(tree.find_all(nodes.For))
    message_vars = {loop.target.name for loop in loops
                    if isinstance(loop.target, nodes.Name)
                    and _reads(loop.iter, messages, None, nodes)}
    contents = set()
    for name in message_vars:
        contents |= _bound_to(tree, name, nodes, key="content")
    for loop in loops:
        if any(_reads(loop.iter, {m}, "content", nodes) for m in message_vars) \
                or _reads(loop.iter, contents - message_vars, None, nodes):
            return "openai"
    return "string"


def _bound_to(tree: Any, name: str, nodes: Any, key: str | None = None) -> set[str]:
    """`name` itself (or, with `key`, nothing) and every variable assigned from it (from
    `name[key]` with a key), transitively."""
    bound, frontier = ({name} if key is None else set()), [(name, key)]
    while frontier:
        var, k = frontier.pop()
        for assign in tree.find_all(nodes.Assign):
            target = assign.target
            if isinstance(target, nodes.Name) and target.name not in bound \
                    and _reads(assign.node, {var}, k, nodes):
                bound.add(target.name)
                frontier.append((target.name, None))
    return bound


def _reads(node: Any, names: set[str], key: str | None, nodes: Any) -> bool:
    """Whether `node` is one of `names` (with `key`: its `[key]` / `.key`), through filters,
    tests and slices."""
    while isinstance(node, nodes.Filter | nodes.Test) or (
            isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice)):
        node = node.node
    if key is not None:
        if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) \
                and node.arg.value == key or isinstance(node, nodes.Getattr) and node.attr == key:
            node = node.node
        else:
            return False
    return isinstance(node, nodes.Name) and node.name in names
