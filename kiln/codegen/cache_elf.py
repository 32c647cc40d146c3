"""Structural checks of ELF object files before a loader sees them.

LLVM's RuntimeDyld (MCJIT) trusts the object it is handed: a section table past the end
of the file segfaults it, a relocation offset outside its section trips an assertion
that aborts the process. The artifact cache authenticates entries first (only kiln's
own output has a valid tag); this is the second wall, so that even an authenticated
but damaged object is rebuilt instead of crashing the process. It checks what a loader
indexes with: the header, the section table, every section's byte range, alignments,
symbol and string table indices, and every relocation's symbol, type and offset.

    >>> check_object(blob, machine=host_machine(), relocatable=True)   # doctest: +SKIP

Only ELF64 little-endian is accepted (x86-64, AArch64, CUDA cubin, AMD hsaco).
"""

from __future__ import annotations

import platform
import struct
import sys

EM_X86_64, EM_AARCH64, EM_CUDA, EM_AMDGPU = 62, 183, 190, 224
ET_REL = 1
_SHT_NULL, _SHT_SYMTAB, _SHT_STRTAB, _SHT_RELA, _SHT_NOBITS, _SHT_REL, _SHT_DYNSYM = 0, 2, 3, 4, 8, 9, 11
_SHN_LORESERVE, _SHN_ABS, _SHN_COMMON = 0xFF00, 0xFFF1, 0xFFF2
_MAX_ALIGN = 1 << 16
_MAX_NOBITS = 1 << 28  # zero-filled sections the loader would allocate
# relocation types RuntimeDyldELF resolves on x86-64 (others abort it), by bytes patched
_X86_64_RELOCS = {0: 0, 1: 8, 2: 4, 4: 4, 9: 4, 10: 4, 11: 4, 12: 2, 13: 2, 14: 1, 15: 1,
                  24: 8, 25: 8, 26: 4, 27: 8, 28: 8, 29: 8, 31: 8, 41: 4, 42: 4}


class BadObject(ValueError):
    """The bytes are not an object file a loader can safely take; the message says why."""


def host_machine() -> int | None:
    """The ELF machine number of this process's CPU; None where objects are not ELF."""
    if not sys.platform.startswith("linux"):
        return None
    return {"x86_64": EM_X86_64, "amd64": EM_X86_64, "aarch64": EM_AARCH64,
            "arm64": EM_AARCH64}.get(platform.machine().lower())


def check_object(data: bytes, machine: int | None = None, relocatable: bool = False) -> None:
    """Raise `BadObject` unless `data` is a well-formed ELF64 little-endian object for
    `machine` (any when None); `relocatable` also requires ET_REL and checks every
    relocation against its target section."""
    if len(data) < 64 or data[:4] != b"\x7fELF":
        raise BadObject("not an ELF file")
    if data[4] != 2 or data[5] != 1 or data[6] != 1:
        raise BadObject("not ELF64 little-endian version 1")
    (e_type, e_machine, _version, _entry, phoff, shoff, _flags, ehsize, phentsize, phnum,
     shentsize, shnum, shstrndx) = struct.unpack_from("<HHIQQQIHHHHHH", data, 16)
    if machine is not None and e_machine != machine:
        raise BadObject(f"ELF machine {e_machine}, expected {machine}")
    if relocatable and e_type != ET_REL:
        raise BadObject(f"ELF type {e_type}, expected a relocatable object")
    if ehsize != 64:
        raise BadObject(f"ELF header size {ehsize}")
    if phnum and (phentsize != 56 or not _fits(phoff, phnum * 56, len(data))):
        raise BadObject("program header table outside the file")
    if shnum == 0 or shentsize != 64 or not _fits(shoff, shnum * 64, len(data)):
        raise BadObject("section table missing or outside the file")
    if shstrndx >= shnum:
        raise BadObject(f"section name table index {shstrndx} of {shnum}")
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + 64 * i) for i in range(shnum)]
    _check_sections(data, sections, shstrndx)
    for i, sec in enumerate(sections):
        if sec[1] in (_SHT_SYMTAB, _SHT_DYNSYM):
            _check_symbols(data, sections, i, relocatable)
    for i, sec in enumerate(sections):
        if sec[1] in (_SHT_RELA, _SHT_REL):
            _check_relocations(data, sections, i, e_machine, relocatable)


# several objects in one payload (a program compiled as several LLVM modules at once):
# MAGIC | u32 count | count x u64 size | the objects, in order
MULTI_MAGIC = b"KILNOBJS"
_MAX_PARTS = 256


def pack_objects(parts: list[bytes]) -> bytes:
    """One payload for several object files (a single object stays as it is)."""
    if len(parts) == 1:
        return parts[0]
    head = MULTI_MAGIC + struct.pack("<I", len(parts)) + b"".join(struct.pack("<Q", len(p)) for p in parts)
    return head + b"".join(parts)


def unpack_objects(data: bytes) -> list[bytes]:
    """The object files of a payload `pack_objects` made (`BadObject` if malformed)."""
    if not data.startswith(MULTI_MAGIC):
        return [data]
    if len(data) < 12:
        raise BadObject("truncated object list")
    (count,) = struct.unpack_from("<I", data, 8)
    if not 2 <= count <= _MAX_PARTS or len(data) < 12 + 8 * count:
        raise BadObject(f"object list of {count} parts")
    sizes = struct.unpack_from(f"<{count}Q", data, 12)
    at = 12 + 8 * count
    if at + sum(sizes) != len(data):
        raise BadObject("object list sizes do not match the payload")
    parts = []
    for size in sizes:
        parts.append(data[at:at + size])
        at += size
    return parts


def _fits(offset: int, size: int, total: int) -> bool:
    return 0 <= offset and 0 <= size and offset + size <= total


def _check_sections(data: bytes, sections: list, shstrndx: int) -> None:
    names = sections[shstrndx]
    if names[1] != _SHT_STRTAB:
        raise BadObject("section name table is not a string table")
    nobits = 0
    for i, (name, kind, _fl, _addr, offset, size, _link, _info, align, _ent) in enumerate(sections):
        if kind == _SHT_NULL:
            continue
        if kind == _SHT_NOBITS:
            nobits += size
        elif not _fits(offset, size, len(data)):
            raise BadObject(f"section {i} ({size} bytes at {offset}) runs past the end of the file")
        if name >= names[5]:
            raise BadObject(f"section {i} name offset {name} outside the name table")
        if align > _MAX_ALIGN or (align & (align - 1)):
            raise BadObject(f"section {i} alignment {align}")
    if nobits > _MAX_NOBITS:
        raise BadObject(f"{nobits} bytes of zero-filled sections")


def _check_symbols(data: bytes, sections: list, index: int, relocatable: bool) -> None:
    _n, _k, _f, _a, offset, size, link, _i, _al, entsize = sections[index]
    if entsize != 24 or size % 24:
        raise BadObject(f"symbol table {index} entry size {entsize}")
    if link >= len(sections) or sections[link][1] != _SHT_STRTAB:
        raise BadObject(f"symbol table {index} names string table {link}")
    strsize = sections[link][5]
    for j in range(size // 24):
        st_name, _info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", data, offset + 24 * j)
        if st_name >= max(strsize, 1):
            raise BadObject(f"symbol {j} name offset {st_name} outside its string table")
        if shndx >= _SHN_LORESERVE:
            if shndx not in (_SHN_ABS, _SHN_COMMON):
                raise BadObject(f"symbol {j} section index {shndx:#x}")
        elif shndx >= len(sections):
            raise BadObject(f"symbol {j} in section {shndx} of {len(sections)}")
        elif relocatable and shndx and value > sections[shndx][5]:
            raise BadObject(f"symbol {j} at offset {value} past the end of section {shndx}")


def _check_relocations(data: bytes, sections: list, index: int, machine: int, relocatable: bool) -> None:
    _n, kind, _f, _a, offset, size, link, info, _al, entsize = sections[index]
    width = 24 if kind == _SHT_RELA else 16
    if entsize != width or size % width:
        raise BadObject(f"relocation section {index} entry size {entsize}")
    if link >= len(sections) or sections[link][1] not in (_SHT_SYMTAB, _SHT_DYNSYM):
        raise BadObject(f"relocation section {index} names symbol table {link}")
    symbols = sections[link][5] // 24
    target = None
    if relocatable:
        if info == 0 or info >= len(sections):
            raise BadObject(f"relocation section {index} applies to section {info}")
        target = sections[info][5]
    for j in range(size // width):
        r_offset, r_info = struct.unpack_from("<QQ", data, offset + width * j)
        sym, rtype = r_info >> 32, r_info & 0xFFFFFFFF
        if sym >= symbols:
            raise BadObject(f"relocation {j} of section {index} names symbol {sym} of {symbols}")
        if machine == EM_X86_64 and rtype not in _X86_64_RELOCS:
            raise BadObject(f"relocation {j} of section {index} has type {rtype}")
        patched = _X86_64_RELOCS[rtype] if machine == EM_X86_64 else 1
        if target is not None and r_offset + patched > target:
            raise BadObject(f"relocation {j} of section {index} at offset {r_offset} "
                            f"outside its {target}-byte section")
