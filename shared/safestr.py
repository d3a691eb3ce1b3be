"""The one rule for strings that come from a profiled process.

Owns: turning what a process controls (a path, its comm, its command line, a
container id) into a string every later stage can carry: valid UTF-8 with no
control characters, of bounded length. The bytes are escaped losslessly:
valid UTF-8 other than a backslash or a control character (C0, DEL, C1, the
line and paragraph separators, the bidirectional overrides) passes unchanged,
a backslash becomes two backslashes, and any other byte becomes \\xNN. A
string longer than its cap is cut and ends in a marker naming a hash of the
whole, so two long names that differ only past the cut stay two names.

Applied once, where the collector reads /proc (collector/procfs.py), and where
the symbolizer reads a name from a process's files (ELF symbols, perf maps), so
the wire, routing, windows and pprof string tables only ever see such strings.

Also owns `printable`, the rule for writing a string that came from anywhere
(a pprof handed to `ebpfprofiler report` is not checked by the rule above) to
a terminal or as one line of a text file: every control character is escaped.

Must not: read anything, or be undone to open a file by name (files are opened
through the collector's file broker by mapping, never by these strings).
"""

from __future__ import annotations

import hashlib
import re
import reprlib

# Characters of a process string after escaping. The wire caps strings at 4096
# (shared/wire.py MAX_STRING); a real path is rarely past a few hundred, and a
# cut one keeps a hash of the whole.
MAX_PROCESS_STRING = 1024
# The end of a string that was cut: "…[cut:" + 16 hex digits of blake2b of the whole + "]".
CUT_MARKER = "…[cut:"

# Characters a terminal or a text reader acts on besides C0 and DEL: the C1 controls, the Unicode line
# and paragraph separators, and the bidirectional embeddings, overrides and isolates (which reorder
# what is shown). Valid UTF-8, but never passed as they are.
_UNICODE_CONTROLS = (*range(0x80, 0xA0), 0x2028, 0x2029, *range(0x202A, 0x202F), *range(0x2066, 0x206A))
_ESCAPES = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}
_ESCAPES[ord("\\")] = "\\\\"
# each of their UTF-8 bytes as \xNN, so that unescape still gives the bytes back
_ESCAPES.update({c: "".join(f"\\x{b:02x}" for b in chr(c).encode()) for c in _UNICODE_CONTROLS})
# Bytes that process_string passes as they are: printable ASCII but the backslash.
_PLAIN = re.compile(rb"[\x20-\x5b\x5d-\x7e]*").fullmatch


def process_string(raw: bytes | str, cap: int = MAX_PROCESS_STRING) -> str:
    """`raw` (bytes, or a str from os.fsdecode/surrogateescape) as valid, escaped, capped UTF-8."""
    if isinstance(raw, bytes) and len(raw) <= cap and _PLAIN(raw):
        return raw.decode("ascii")  # most names: the same result, 3x faster (a library has 100,000s)
    data = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else bytes(raw)
    # backslashreplace writes \xNN for each byte that is not valid UTF-8; the literal backslashes
    # and control characters are escaped first, so the result reads back to exactly `data`.
    text = data.decode("utf-8", "surrogateescape").translate(_ESCAPES)
    text = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    if len(text) <= cap:
        return text
    tag = f"{CUT_MARKER}{hashlib.blake2b(data, digest_size=8).hexdigest()}]"
    return text[: max(0, cap - len(tag))] + tag


def unescape(text: str) -> bytes:
    """The bytes `process_string` escaped into `text` (for tests and for reading a name back)."""
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1 : i + 2] == "\\":
            out += b"\\"
            i += 2
        elif c == "\\" and text[i + 1 : i + 2] == "x":
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        else:
            out += c.encode()
            i += 1
    return bytes(out)


# What `printable` escapes: C0 controls and DEL as \xNN (as process_string does); the other controls
# (_UNICODE_CONTROLS) and lone surrogates (which no terminal can be sent) as \uNNNN.
_UNPRINTABLE = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F)}
_UNPRINTABLE.update({c: f"\\u{c:04x}" for c in (*_UNICODE_CONTROLS, *range(0xD800, 0xE000))})


def printable(text: str) -> str:
    """`text` with no character a terminal acts on and no line break of any kind: safe to print, and to
    write as one line (folded stacks, the top table). Not lossless (a backslash stays one); for showing."""
    return text.translate(_UNPRINTABLE)


# Characters of an offending value quoted in an error message or a log line: enough to recognise it,
# never a 3 MB log line from a 3 MB message.
MAX_QUOTED = 200


def cut(text: str, cap: int = MAX_QUOTED) -> str:
    """`text`, or its first `cap` characters and how many more there were."""
    return text if len(text) <= cap else f"{text[:cap]}… ({len(text) - cap} more characters)"


def quote(value: object, cap: int = MAX_QUOTED) -> str:
    """repr(value) cut to about `cap` characters; reprlib elides inside containers, so a huge one is never
    repr'd whole first."""
    try:
        return cut(_QUOTER.repr(value), cap)
    except ValueError:  # an int of more digits than repr() writes (sys.get_int_max_str_digits)
        return f"<{type(value).__name__} too large to write>"


_QUOTER = reprlib.Repr()
_QUOTER.maxstring = _QUOTER.maxother = MAX_QUOTED
_QUOTER.maxlevel = 3
