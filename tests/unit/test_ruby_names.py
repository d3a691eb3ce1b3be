"""Ruby frames' class names and the ring of ractors, on crafted process memory.

RubyProcess names a method after its method entry's owner as Ruby's
rb_profile_frame_full_label does: "Worker#hot", "Worker.cls" for a singleton
class's method, "block in Worker#hot" through the chain of environments,
the entry behind an svar in a method's own environment; no class for an
anonymous class, a temporary path or a singleton of an ordinary object.
What is not what it must be (an owner that is no class, an environment
that cannot be read, a chain of environments that does not end) is counted
by reason and leaves the bare label. Its threads are those of every ractor
on the VM's ring, each checked to point back to the VM and to its ractor;
a ring that does not close is cut at the cap. The memory is a dict of
regions; the layout is 3.3's (the integration tests read real processes).
"""

from __future__ import annotations

import struct

from runtimes.memory import MemoryReadError, ProcessMemory
from runtimes.ruby import layouts, reader
from runtimes.ruby.layouts import LAYOUTS
from runtimes.ruby.reader import RubyProcess, _Iseq

LAY = LAYOUTS[(3, 3)]
IMEMO_MENT = layouts.T_IMEMO | layouts.IMEMO_MENT << layouts.FL_USHIFT
IMEMO_SVAR = layouts.T_IMEMO | layouts.IMEMO_SVAR << layouts.FL_USHIFT
IMEMO_CREF = layouts.T_IMEMO | 1 << layouts.FL_USHIFT
QNIL = 0x04


class FakeMemory(ProcessMemory):
    """Regions of words at addresses; a read outside them fails as an unmapped address does."""

    def __init__(self) -> None:
        self.regions: dict[int, bytearray] = {}

    def put(self, address: int, *words: int) -> int:
        self.regions[address] = bytearray(struct.pack(f"<{len(words)}Q", *words))
        return address

    def read(self, address: int, size: int) -> bytes:
        for base, data in self.regions.items():
            if base <= address and address + size <= base + len(data):
                return bytes(data[address - base : address - base + size])
        raise MemoryReadError("unmapped", f"{address:#x}")

    def read_many(self, requests: list[tuple[int, int]]) -> list[bytes | None]:
        out: list[bytes | None] = []
        for address, size in requests:
            try:
                out.append(self.read(address, size) if size else None)
            except MemoryReadError:
                out.append(None)
        return out

    def u64(self, address: int) -> int:
        return int.from_bytes(self.read(address, 8), "little")

    u64_or_none = ProcessMemory.u64_or_none  # the reader's own, over these regions


def words(n: int, at: dict[int, int]) -> list[int]:
    """n words, zero but for byte offset → value."""
    out = [0] * n
    for off, value in at.items():
        out[off // 8] = value
    return out


def string(mem: FakeMemory, address: int, text: str) -> int:
    """An embedded RString."""
    raw = text.encode()
    head = struct.pack("<QQQ", layouts.T_STRING, 0, len(raw)) + raw.ljust(64, b"\0")
    mem.regions[address] = bytearray(head)
    return address


def klass(mem: FakeMemory, address: int, flags: int, path: int = 0, attached: int = 0) -> int:
    return mem.put(
        address, *words(LAY.class_path // 8 + 1, {0: flags, LAY.class_path: path, LAY.class_attached: attached})
    )


def method_entry(mem: FakeMemory, address: int, owner: int) -> int:
    return mem.put(address, IMEMO_MENT, 0, 0, 0, owner)


def env(mem: FakeMemory, ep: int, me_cref: int, prev: int, local: bool) -> int:
    """ep[-2], ep[-1] (the previous ep, tagged), ep[0] (flags); returns ep."""
    mem.put(ep - 16, me_cref, prev | 1 if prev else 0, layouts.ENV_FLAG_LOCAL if local else 0)
    return ep


def names(r: RubyProcess, mem: FakeMemory, frames: list[tuple[str, str, int]]) -> list[str]:
    """Each frame's name as the reader gives it, for (label, base label, ep) triples."""
    owners = r.names.owners(mem, [ep for _, _, ep in frames])
    return [
        r.names.named(mem, _Iseq(label, base, "/w.rb", 0, 0, [], 0, {}), 0, owner).function
        for (label, base, _), owner in zip(frames, owners)
    ]


def world() -> tuple[FakeMemory, dict[str, int]]:
    mem = FakeMemory()
    worker = klass(mem, 0x10000, layouts.T_CLASS, path=string(mem, 0x20000, "Worker"))
    single = klass(mem, 0x11000, layouts.T_CLASS | LAY.fl_singleton, attached=worker)
    anon = klass(mem, 0x12000, layouts.T_CLASS, path=QNIL)
    temp = klass(mem, 0x13000, layouts.T_CLASS, path=string(mem, 0x21000, "#<Class:0x00007f>"))
    obj = mem.put(0x14000, *words(LAY.class_path // 8 + 1, {0: 0x01}))  # a T_OBJECT
    obj_single = klass(mem, 0x15000, layouts.T_CLASS | LAY.fl_singleton, attached=obj)
    mes = {
        name: method_entry(mem, 0x30000 + 0x100 * i, owner)
        for i, (name, owner) in enumerate(
            (("hot", worker), ("cls", single), ("anon", anon), ("temp", temp), ("obj", obj_single), ("bad", obj))
        )
    }
    svar = mem.put(0x32000, IMEMO_SVAR, mes["cls"], 0, 0, 0)
    cref = mem.put(0x33000, IMEMO_CREF, 0, 0, 0, 0)
    eps = {name: env(mem, 0x40010 + 0x100 * i, me, 0, True) for i, (name, me) in enumerate(mes.items())}
    eps["svar"] = env(mem, 0x41010, svar, 0, True)
    eps["main"] = env(mem, 0x41110, cref, 0, True)
    eps["block"] = env(mem, 0x41210, 0, eps["hot"], False)
    eps["block2"] = env(mem, 0x41310, 0, eps["block"], False)
    eps["loop"] = env(mem, 0x41410, 0, 0x41410, False)
    return mem, eps


def test_methods_are_named_with_their_class_as_ruby_names_them() -> None:
    mem, eps = world()
    r = RubyProcess("3.3.8", LAY, 0)
    got = names(
        r,
        mem,
        [
            ("hot", "hot", eps["hot"]),
            ("cls", "cls", eps["cls"]),
            ("cls", "cls", eps["svar"]),
            ("block in hot", "hot", eps["block"]),
            ("block (2 levels) in hot", "hot", eps["block2"]),
            ("<main>", "<main>", eps["main"]),
            ("go", "go", eps["anon"]),
            ("t", "t", eps["temp"]),
            ("single", "single", eps["obj"]),
        ],
    )
    assert got == [
        "Worker#hot",
        "Worker.cls",
        "Worker.cls",
        "block in Worker#hot",
        "block (2 levels) in Worker#hot",
        "<main>",
        "go",
        "t",
        "single",
    ], got
    assert r.dropped == {}, r.dropped


def test_what_is_not_what_it_must_be_is_counted_and_keeps_the_bare_label() -> None:
    mem, eps = world()
    r = RubyProcess("3.3.8", LAY, 0)
    got = names(r, mem, [("bad", "bad", eps["bad"]), ("x", "x", 0x7000), ("block in y", "y", eps["loop"])])
    assert got == ["bad", "x", "block in y"], got
    assert r.dropped == {"bad_class": 1, "bad_env": 1, "env_too_deep": 1}, r.dropped


def test_every_ractor_s_threads_are_read_and_a_ring_that_does_not_close_is_cut() -> None:
    mem = FakeMemory()
    vm, main, other = 0x1000, 0x2000, 0x3000
    th_words = LAY.th_ec // 8 + 1

    def ractor(address: int, threads: list[int]) -> None:
        nodes = [t + LAY.th_node for t in threads]
        head = address + LAY.ractor_threads
        mem.put(address, *words(LAY.ractor_node // 8 + 2, {LAY.ractor_threads: nodes[0] if nodes else head}))
        for t, nxt in zip(threads, [*nodes[1:], head]):
            mem.put(
                t,
                *words(
                    th_words,
                    {LAY.th_node: nxt, LAY.th_vm: vm, LAY.th_ractor: address, LAY.th_ec: t + 0x800, LAY.th_nt: 0},
                ),
            )

    ractor(main, [0x5000, 0x5100])
    ractor(other, [0x6000])
    head = vm + LAY.vm_ractor_set
    mem.put(
        vm,
        *words(
            LAY.vm_main_thread + 8,
            {LAY.vm_ractor_set: main + LAY.ractor_node, LAY.vm_main_ractor: main, LAY.vm_main_thread: 0x5000},
        ),
    )
    # The ring: vm head → main's node → other's node → head.
    mem.regions[main][LAY.ractor_node : LAY.ractor_node + 8] = struct.pack("<Q", other + LAY.ractor_node)
    mem.regions[other][LAY.ractor_node : LAY.ractor_node + 8] = struct.pack("<Q", head)
    r = RubyProcess("3.3.8", LAY, vm)
    assert [t for t, _, _ in r.threads(mem)] == [0x5000, 0x5100, 0x6000]
    assert r.dropped == {}
    # A ring that never comes back to its head is cut at MAX_RACTORS, and counted.
    mem.regions[other][LAY.ractor_node : LAY.ractor_node + 8] = struct.pack("<Q", 0x9000 + LAY.ractor_node)
    for i in range(reader.MAX_RACTORS + 2):
        at = 0x9000 + i * 0x1000
        mem.put(
            at,
            *words(
                LAY.ractor_node // 8 + 2,
                {LAY.ractor_threads: at + LAY.ractor_threads, LAY.ractor_node: at + 0x1000 + LAY.ractor_node},
            ),
        )
    assert [t for t, _, _ in r.threads(mem)] == [0x5000, 0x5100, 0x6000]
    assert r.dropped == {"too_many_ractors": 1}, r.dropped
