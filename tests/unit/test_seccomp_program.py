"""The ClientApp sandbox's seccomp program (simulations/deploy/clientapp_sandbox.py), run on a classic-BPF
interpreter: sysinfo and perf_event_open fail with EPERM for every listed system-call ABI, every other call
of a listed ABI is allowed, and any call of an unlisted ABI fails with ENOSYS (a review: the first program
allowed every call of the ABIs it did not list, s390's 31-bit, rv32 and ppc32 among them, and a ClientApp
can run its own 32-bit binary). tests/integration/test_clientapp_sandbox.py installs it for real."""

from __future__ import annotations

from simulations.deploy.clientapp_sandbox import DENIED, seccomp_program

ALLOW, EPERM, ENOSYS = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
SYSINFO = {0xC000003E: 99, 0x40000003: 116, 0xC00000B7: 179, 0x40000028: 116, 0xC00000F3: 179, 0x400000F3: 179}
SYSINFO |= {0xC0000015: 116, 0x00000014: 116, 0x80000016: 116, 0x00000016: 116}  # kernel syscall tables


def run(program: list[tuple[int, int, int, int]], arch: int, nr: int) -> int:
    """The value the program returns for a call ``nr`` of ABI ``arch`` (ld abs, jeq k, ja, ret k only)."""
    pc, acc = 0, 0
    for _ in range(len(program) + 1):
        code, jt, jf, k = program[pc]
        assert 0 <= jt <= 255 and 0 <= jf <= 255 and 0 <= k < 1 << 32  # the struct's field widths
        if code == 0x20:  # BPF_LD | BPF_W | BPF_ABS
            acc = {0: nr, 4: arch}[k]
            pc += 1
        elif code == 0x15:  # BPF_JMP | BPF_JEQ | BPF_K
            pc += 1 + (jt if acc == k else jf)
        elif code == 0x05:  # BPF_JMP | BPF_JA
            pc += 1 + k
        elif code == 0x06:  # BPF_RET | BPF_K
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("the program did not return")


def test_every_listed_abi_denies_sysinfo_and_perf_event_open_and_allows_the_rest() -> None:
    program = seccomp_program(DENIED)
    assert {arch for arch, _ in DENIED} == set(SYSINFO)
    for arch, numbers in DENIED:
        assert SYSINFO[arch] in numbers
        for nr in range(1024):
            assert run(program, arch, nr) == (EPERM if nr in numbers else ALLOW), (hex(arch), nr)
    x86_64 = 0xC000003E
    assert run(program, x86_64, 0x40000000 | 99) == EPERM  # x32's sysinfo
    assert run(program, x86_64, 0x40000000 | 0) == ALLOW  # x32's read


def test_an_unlisted_abi_gets_enosys_for_every_call() -> None:
    program = seccomp_program(DENIED)
    for arch in (0x12345678, 0x40000008, 0x0000003E, 0):  # made up, mips, x86_64 without its 64-bit flag
        assert {run(program, arch, nr) for nr in range(0, 600, 7)} == {ENOSYS}
