"""Crafted ELF files for the tests of the runtime reader's symbol reading (runtimes/elfsyms.py).

Owns: symbol_table_elf(), a 64-bit little-endian shared object with one PT_LOAD and a symbol table of
as many symbols as asked (every one named by the one string in its string table), which its section
headers may list many times over or claim to be of any size. Must not: be used by the stages.
"""

from __future__ import annotations

import struct

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
SHT_SYMTAB, SHT_STRTAB = 2, 3


def symbol_table_elf(
    symbols: int, *, tables: int = 1, claimed_bytes: int | None = None, name: bytes = b"spam"
) -> bytes:
    """An ELF file whose .symtab holds `symbols` entries (a function `name` at 0x1000 each), listed
    `tables` times in its section headers, each claiming `claimed_bytes` (default: its true size)."""
    strtab = b"\0" + name + b"\0"
    symtab = bytes(_SYM.size) + _SYM.pack(1, 0x12, 0, 1, 0x1000, 8) * (symbols - 1)
    shstr = b"\0.symtab\0.strtab\0.shstrtab\0"
    at_sym = _EHDR.size + _PHDR.size
    at_str = at_sym + len(symtab)
    at_shstr = at_str + len(strtab)
    at_sh = (at_shstr + len(shstr) + 7) & ~7
    strtab_index = 1 + tables

    def section(name_at: int, kind: int, offset: int, size: int, link: int, entsize: int) -> bytes:
        return _SHDR.pack(name_at, kind, 0, 0, offset, size, link, 0, 8, entsize)

    headers = section(0, 0, 0, 0, 0, 0)
    headers += (
        section(1, SHT_SYMTAB, at_sym, len(symtab) if claimed_bytes is None else claimed_bytes, strtab_index, _SYM.size)
        * tables
    )
    headers += section(9, SHT_STRTAB, at_str, len(strtab), 0, 0) + section(17, SHT_STRTAB, at_shstr, len(shstr), 0, 0)
    n_sections = tables + 3
    ident = b"\x7fELF\x02\x01\x01" + bytes(9)
    ehdr = _EHDR.pack(
        ident, 3, 62, 1, 0, _EHDR.size, at_sh, 0, _EHDR.size, _PHDR.size, 1, _SHDR.size, n_sections, n_sections - 1
    )
    phdr = _PHDR.pack(1, 5, 0, 0, 0, at_sh, at_sh, 0x1000)
    body = ehdr + phdr + symtab + strtab + shstr
    return body + bytes(at_sh - len(body)) + headers
