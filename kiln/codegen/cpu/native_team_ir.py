"""The LLVM IR of kiln's native thread team (native_team.py): the team's memory layout
(word offsets, each contended word on a cache line of its own), the region's fields,
and the text of `kiln_team_worker`, `kiln_team_for`, `kiln_team_claim`, `kiln_team_wake`,
`kiln_team_stop`, `kiln_team_publish` and `kiln_team_set_trace`, plus the IR snippets the
split launchers splice in (`cut_ir`, `range_ir`). native_team.py holds the Python side:
the team's threads, publishing, waking, steering and the timeline. See its docstring for
how a region is published, claimed and joined.
"""

from __future__ import annotations

import os
import platform

# a worker's spin after its last region: a worker that fell asleep inside a step (a
# stretch of serial launches longer than its spin) arrives late at the next region and
# claims the last chunk, which the caller then waits for; the GPT step in rounds of 3
# steps after 0.2 s pauses (bench_train's pattern) ran 5.55-7.61 ms (pooled medians,
# 5 rounds) at 5 ms against 6.59-7.61 at 1 ms, libgomp 5.67-7.91
SPIN_US = int(os.environ.get("KILN_TEAM_SPIN_US", "5000"))
MAX_UNITS = (1 << 20) - 1  # the claim word holds 20-bit unit counts
_FUTEX = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98}
_PAUSE = {"x86_64": "call void @llvm.x86.sse2.pause()", "amd64": "call void @llvm.x86.sse2.pause()"}
_WORDS = 96  # the team's memory, in i64 words (81 used, 64-byte aligned within)
TRACE_WORDS = 8  # a timeline record: t0, t1, t2, units, caller's units, first claim, kind, quiet
WAKE_KIND = 2  # a record's kind: 0 static cut, 1 claimed units, 2 a wake without a region

# word offsets in the team's memory (each contended word on a cache line of its own)
SEQ, SLEEPERS, CLAIM, DONE, FIELDS, STOP, OWNER, TRACE_CLAIM, QUIET = 0, 8, 16, 24, 32, 48, 56, 64, 72
# the nanoseconds callers waited, after their own units, for units workers had claimed (a
# running total since the team started: a worker that lost its core in the middle of a
# unit shows here as a time slice, a caller that lost its own core does not)
JOIN_WAIT = 80
# a region's `threads` argument with this bit set: its workers sleep right after it instead
# of spinning SPIN_US (a region run while other processes keep the CPUs busy, where a
# spinning worker would hold a core they want; kiln/runtime/native_loops.py)
QUIET_WORKERS = 1 << 16
FN, BUFS, SIZES, TOTAL, UNIT, NUNITS, MODE, NTHREADS = range(FIELDS, FIELDS + 8)


def _w(k: int, var: str = "%t") -> str:
    return f"getelementptr i64, ptr {var}, i64 {k}"


def cut_ir(parts: str) -> str:
    """IR lines defining %cut: the length of each of `parts` near-equal chunks of
    [0, %total), a multiple of %unit (the pool's cut, `compiled.split`)."""
    return f"""  %cut.a = add i64 %total, {parts}
  %cut.b = sub i64 %cut.a, 1
  %cut.per = udiv i64 %cut.b, {parts}
  %cut.um1 = sub i64 %unit, 1
  %cut.c = add i64 %cut.per, %cut.um1
  %cut.d = udiv i64 %cut.c, %unit
  %cut = mul i64 %cut.d, %unit"""


def range_ir(index: str, chunk: str) -> str:
    """IR lines that call %fn(%bufs, %sizes, lo, hi) on chunk `index` of length `chunk`
    (clipped to %total; nothing when empty), then branch to %done."""
    return f"""  %lo = mul i64 {index}, {chunk}
  %e = add i64 %lo, {chunk}
  %over = icmp sgt i64 %e, %total
  %hi = select i1 %over, i64 %total, i64 %e
  %some = icmp slt i64 %lo, %hi
  br i1 %some, label %run, label %done
run:
  call void %fn(ptr %bufs, ptr %sizes, i64 %lo, i64 %hi)
  br label %done"""


def _record_stores() -> str:
    """IR lines storing `team_record`'s arguments, in order, from buf[%base] on."""
    names = ("t0", "t1", "t2", "n", "mine", "claim", "kind", "quiet")
    lines = ["  %p0 = getelementptr i64, ptr %buf, i64 %base"]
    lines += [f"  %p{k} = getelementptr i64, ptr %p0, i64 {k}" for k in range(1, len(names))]
    lines += [f"  store i64 %{name}, ptr %p{k}" for k, name in enumerate(names)]
    return "\n".join(lines)


def team_ir() -> str:
    """The team's LLVM IR: `kiln_team_worker`, `kiln_team_for`, `kiln_team_claim`,
    `kiln_team_wake` and `kiln_team_stop`, over the team whose address is in the global
    `kiln_team_ptr` (null: every region runs serial on its caller)."""
    machine = platform.machine().lower()
    futex = _FUTEX[machine]
    pause = _PAUSE.get(machine, "")
    return f"""
@kiln_team_ptr = internal global ptr null
@kiln_team_trace = internal global ptr null
@kiln_team_wait = private constant [2 x i64] [i64 0, i64 100000000]
declare i64 @syscall(i64, ...)
declare i32 @clock_gettime(i32, ptr)
{"declare void @llvm.x86.sse2.pause()" if pause else ""}

define internal i64 @team_now() {{
entry:
  %ts = alloca [2 x i64]
  call i32 @clock_gettime(i32 1, ptr %ts)
  %s = load i64, ptr %ts
  %pn = getelementptr i64, ptr %ts, i64 1
  %ns = load i64, ptr %pn
  %a = mul i64 %s, 1000000000
  %r = add i64 %a, %ns
  ret i64 %r
}}

; the timeline (`trace`): append record [t0, t1, t2, units, caller's units, first worker
; claim, kind, quiet] to the buffer [count, capacity, records...], while there is room
define internal void @team_record(ptr %buf, i64 %t0, i64 %t1, i64 %t2, i64 %n, i64 %mine, i64 %claim,
                                  i64 %kind, i64 %quiet) {{
entry:
  %count = load i64, ptr %buf
  %pcap = getelementptr i64, ptr %buf, i64 1
  %cap = load i64, ptr %pcap
  %room = icmp slt i64 %count, %cap
  br i1 %room, label %put, label %exit
put:
  %base0 = mul i64 %count, {TRACE_WORDS}
  %base = add i64 %base0, 2
{_record_stores()}
  %c1 = add i64 %count, 1
  store i64 %c1, ptr %buf
  br label %exit
exit:
  ret void
}}

define void @kiln_team_set_trace(ptr %buf) {{
entry:
  store atomic ptr %buf, ptr @kiln_team_trace seq_cst, align 8
  ret void
}}

; run unit %i of the region now published (its fields are read after the unit's claim)
define internal void @team_unit(ptr %t, i64 %i) {{
entry:
  %pfn = {_w(FN)}
  %fn = load ptr, ptr %pfn
  %pb = {_w(BUFS)}
  %bufs = load ptr, ptr %pb
  %ps = {_w(SIZES)}
  %sizes = load ptr, ptr %ps
  %pt = {_w(TOTAL)}
  %total = load i64, ptr %pt
  %pu = {_w(UNIT)}
  %unit = load i64, ptr %pu
  %pn = {_w(NUNITS)}
  %n = load i64, ptr %pn
  %pm = {_w(MODE)}
  %mode = load i64, ptr %pm
{cut_ir("%n")}
  %claimed = icmp ne i64 %mode, 0
  %chunk = select i1 %claimed, i64 %unit, i64 %cut
{range_ir("%i", "%chunk")}
done:
  %pd = {_w(DONE)}
  atomicrmw add ptr %pd, i64 1 release
  ret void
}}

; claim and run units of the region tagged %tag until none is left (or it is over); the
; units it ran. A worker (%worker) stamps its first claim of the region while tracing.
define internal i64 @team_work(ptr %t, i64 %tag, i1 %worker) {{
entry:
  %pc = {_w(CLAIM)}
  br label %head
head:
  %ran = phi i64 [ 0, %entry ], [ %ran1, %run ], [ %ran, %take ]
  %v = load atomic i64, ptr %pc acquire, align 8
  %vtag = lshr i64 %v, 40
  %mine = icmp eq i64 %vtag, %tag
  br i1 %mine, label %check, label %exit
check:
  %nsh = lshr i64 %v, 20
  %n = and i64 %nsh, {MAX_UNITS}
  %i = and i64 %v, {MAX_UNITS}
  %left = icmp ult i64 %i, %n
  br i1 %left, label %take, label %exit
take:
  %v1 = add i64 %v, 1
  %r = cmpxchg ptr %pc, i64 %v, i64 %v1 acq_rel acquire
  %ok = extractvalue {{ i64, i1 }} %r, 1
  br i1 %ok, label %stamp, label %head
stamp:
  %tr = load atomic ptr, ptr @kiln_team_trace monotonic, align 8
  %tracing = icmp ne ptr %tr, null
  %first = icmp eq i64 %ran, 0
  %w1 = and i1 %tracing, %worker
  %w2 = and i1 %w1, %first
  br i1 %w2, label %claimed, label %run
claimed:
  %pcl = {_w(TRACE_CLAIM)}
  %tc = call i64 @team_now()
  %xc = cmpxchg ptr %pcl, i64 0, i64 %tc monotonic monotonic
  br label %run
run:
  call void @team_unit(ptr %t, i64 %i)
  %ran1 = add i64 %ran, 1
  br label %head
exit:
  ret i64 %ran
}}

; a worker: wait for a new region (spin %spin_ns, then sleep on the futex), take part
; if its index is below the region's thread count, again until the team stops
define void @kiln_team_worker(ptr %t, i64 %index, i64 %spin_ns) {{
entry:
  %lastp = alloca i32
  %t0p = alloca i64
  %kp = alloca i64
  %spp = alloca i64
  store i64 %spin_ns, ptr %spp
  %pseq = {_w(SEQ)}
  %pstop = {_w(STOP)}
  %psl = {_w(SLEEPERS)}
  %pnt = {_w(NTHREADS)}
  %s0 = load atomic i32, ptr %pseq acquire, align 8
  store i32 %s0, ptr %lastp
  br label %wait
wait:
  %now0 = call i64 @team_now()
  store i64 %now0, ptr %t0p
  store i64 0, ptr %kp
  br label %spin
spin:
  %last = load i32, ptr %lastp
  %s = load atomic i32, ptr %pseq acquire, align 8
  %new = icmp ne i32 %s, %last
  br i1 %new, label %got, label %spin_stop
spin_stop:
  %stop = load atomic i64, ptr %pstop monotonic, align 8
  %stopped = icmp ne i64 %stop, 0
  br i1 %stopped, label %exit, label %relax
relax:
  {pause}
  %k = load i64, ptr %kp
  %k1 = add i64 %k, 1
  store i64 %k1, ptr %kp
  %m = and i64 %k1, 63
  %tick = icmp eq i64 %m, 0
  br i1 %tick, label %clock, label %spin
clock:
  %now = call i64 @team_now()
  %t0 = load i64, ptr %t0p
  %el = sub i64 %now, %t0
  %spincur = load i64, ptr %spp
  %long = icmp sgt i64 %el, %spincur
  br i1 %long, label %sleep, label %spin
sleep:
  atomicrmw add ptr %psl, i64 1 seq_cst
  %last2 = load i32, ptr %lastp
  %s2 = load atomic i32, ptr %pseq seq_cst, align 8
  %stop2 = load atomic i64, ptr %pstop seq_cst, align 8
  %same = icmp eq i32 %s2, %last2
  %run2 = icmp eq i64 %stop2, 0
  %doze = and i1 %same, %run2
  br i1 %doze, label %futex, label %woke
futex:
  %l64 = zext i32 %last2 to i64
  %w = call i64 (i64, ...) @syscall(i64 {futex}, ptr %pseq, i64 128, i64 %l64, ptr @kiln_team_wait)
  br label %woke
woke:
  atomicrmw sub ptr %psl, i64 1 seq_cst
  %last3 = load i32, ptr %lastp
  %s3 = load atomic i32, ptr %pseq acquire, align 8
  %new3 = icmp ne i32 %s3, %last3
  br i1 %new3, label %got, label %sleep_again
sleep_again:
  %stop3 = load atomic i64, ptr %pstop monotonic, align 8
  %stopped3 = icmp ne i64 %stop3, 0
  br i1 %stopped3, label %exit, label %sleep
got:
  %sg = load atomic i32, ptr %pseq acquire, align 8
  store i32 %sg, ptr %lastp
  store i64 %spin_ns, ptr %spp
  %nt = load atomic i64, ptr %pnt monotonic, align 8
  %me = add i64 %index, 1
  %part = icmp slt i64 %me, %nt
  br i1 %part, label %work, label %wait
work:
  %sz = zext i32 %sg to i64
  %tag = and i64 %sz, 16777215
  %wr = call i64 @team_work(ptr %t, i64 %tag, i1 true)
  %pq = {_w(QUIET)}
  %q = load atomic i64, ptr %pq monotonic, align 8
  %hush = icmp ne i64 %q, 0
  %after = select i1 %hush, i64 0, i64 %spin_ns
  store i64 %after, ptr %spp
  br label %wait
exit:
  ret void
}}

; the caller's side of a region (mode 0: a static cut into `threads` chunks; 1: units of
; `unit` points); serial where the team is missing or busy, or one unit would do
define internal void @team_region(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit0, i32 %threads,
                                  i64 %mode) {{
entry:
  %t = load atomic ptr, ptr @kiln_team_ptr acquire, align 8
  %none = icmp eq ptr %t, null
  %nthreads = and i32 %threads, 65535
  %quiet32 = lshr i32 %threads, 16
  %few = icmp sle i32 %nthreads, 1
  %empty = icmp sle i64 %total, 0
  %x1 = or i1 %none, %few
  %x2 = or i1 %x1, %empty
  br i1 %x2, label %serial, label %count
count:
  %nt = sext i32 %nthreads to i64
  ; claim mode: units of `unit`, coarsened (whole multiples) to at most MAX_UNITS
  %um1 = sub i64 %unit0, 1
  %tu = add i64 %total, %um1
  %nu0 = udiv i64 %tu, %unit0
  %toomany = icmp ugt i64 %nu0, {MAX_UNITS}
  %a1 = add i64 %total, {MAX_UNITS - 1}
  %per = udiv i64 %a1, {MAX_UNITS}
  %a2 = add i64 %per, %um1
  %a3 = udiv i64 %a2, %unit0
  %big = mul i64 %a3, %unit0
  %cunit = select i1 %toomany, i64 %big, i64 %unit0
  %cm1 = sub i64 %cunit, 1
  %tc = add i64 %total, %cm1
  %cn = udiv i64 %tc, %cunit
  ; static cut: min(threads, units of `unit`)
  %sfew = icmp slt i64 %nu0, %nt
  %sn = select i1 %sfew, i64 %nu0, i64 %nt
  %claimed = icmp ne i64 %mode, 0
  %n = select i1 %claimed, i64 %cn, i64 %sn
  %unit = select i1 %claimed, i64 %cunit, i64 %unit0
  %one = icmp sle i64 %n, 1
  br i1 %one, label %serial, label %lock
lock:
  %po = {_w(OWNER)}
  %lk = cmpxchg ptr %po, i64 0, i64 1 acquire monotonic
  %got = extractvalue {{ i64, i1 }} %lk, 1
  br i1 %got, label %publish, label %serial
publish:
  %trace = load atomic ptr, ptr @kiln_team_trace monotonic, align 8
  %tracing = icmp ne ptr %trace, null
  br i1 %tracing, label %stamp0, label %fields
stamp0:
  %pcl = {_w(TRACE_CLAIM)}
  store atomic i64 0, ptr %pcl monotonic, align 8
  %ts0 = call i64 @team_now()
  br label %fields
fields:
  %t0 = phi i64 [ 0, %publish ], [ %ts0, %stamp0 ]
  %pfn = {_w(FN)}
  store ptr %fn, ptr %pfn
  %pb = {_w(BUFS)}
  store ptr %bufs, ptr %pb
  %ps = {_w(SIZES)}
  store ptr %sizes, ptr %ps
  %pt = {_w(TOTAL)}
  store i64 %total, ptr %pt
  %pu = {_w(UNIT)}
  store i64 %unit, ptr %pu
  %pn = {_w(NUNITS)}
  store i64 %n, ptr %pn
  %pm = {_w(MODE)}
  store i64 %mode, ptr %pm
  %pnt = {_w(NTHREADS)}
  store atomic i64 %nt, ptr %pnt monotonic, align 8
  %pq = {_w(QUIET)}
  %quiet = zext i32 %quiet32 to i64
  store atomic i64 %quiet, ptr %pq monotonic, align 8
  %pd = {_w(DONE)}
  store atomic i64 0, ptr %pd monotonic, align 8
  %pseq = {_w(SEQ)}
  %s = load atomic i32, ptr %pseq monotonic, align 8
  %s1 = add i32 %s, 1
  %sz = zext i32 %s1 to i64
  %tag = and i64 %sz, 16777215
  %th = shl i64 %tag, 40
  %nh = shl i64 %n, 20
  %v = or i64 %th, %nh
  %pc = {_w(CLAIM)}
  store atomic i64 %v, ptr %pc release, align 8
  store atomic i32 %s1, ptr %pseq seq_cst, align 8
  %psl = {_w(SLEEPERS)}
  %sl = load atomic i64, ptr %psl seq_cst, align 8
  %asleep = icmp sgt i64 %sl, 0
  br i1 %asleep, label %wake, label %work
wake:
  %w = call i64 (i64, ...) @syscall(i64 {futex}, ptr %pseq, i64 129, i64 2147483647)
  br label %work
work:
  %mine = call i64 @team_work(ptr %t, i64 %tag, i1 false)
  br i1 %tracing, label %stamp1, label %join0
stamp1:
  %ts1 = call i64 @team_now()
  br label %join0
join0:
  %t1 = phi i64 [ 0, %work ], [ %ts1, %stamp1 ]
  %d0 = load atomic i64, ptr %pd acquire, align 8
  %all0 = icmp uge i64 %d0, %n
  br i1 %all0, label %joined, label %wait0
wait0:
  %tw0 = call i64 @team_now()
  br label %join
join:
  %d = load atomic i64, ptr %pd acquire, align 8
  %all = icmp uge i64 %d, %n
  br i1 %all, label %waited, label %jrelax
jrelax:
  {pause}
  br label %join
waited:
  %tw1 = call i64 @team_now()
  %dw = sub i64 %tw1, %tw0
  %pjw = {_w(JOIN_WAIT)}
  %jw = load atomic i64, ptr %pjw monotonic, align 8
  %jw1 = add i64 %jw, %dw
  store atomic i64 %jw1, ptr %pjw monotonic, align 8
  br label %joined
joined:
  br i1 %tracing, label %record, label %unlock
record:
  %ts2 = call i64 @team_now()
  %pcl2 = {_w(TRACE_CLAIM)}
  %claim = load atomic i64, ptr %pcl2 monotonic, align 8
  call void @team_record(ptr %trace, i64 %t0, i64 %t1, i64 %ts2, i64 %n, i64 %mine, i64 %claim, i64 %mode,
                         i64 %quiet)
  br label %unlock
unlock:
  store atomic i64 0, ptr %po release, align 8
  ret void
serial:
  call void %fn(ptr %bufs, ptr %sizes, i64 0, i64 %total)
  ret void
}}

define void @kiln_team_for(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit, i32 %threads) {{
entry:
  call void @team_region(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit, i32 %threads, i64 0)
  ret void
}}

define void @kiln_team_claim(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit, i32 %threads) {{
entry:
  call void @team_region(ptr %fn, ptr %bufs, ptr %sizes, i64 %total, i64 %unit, i32 %threads, i64 1)
  ret void
}}

; wake sleeping workers without a region (they find nothing to claim and spin again)
define void @kiln_team_wake() {{
entry:
  %t = load atomic ptr, ptr @kiln_team_ptr acquire, align 8
  %none = icmp eq ptr %t, null
  br i1 %none, label %exit, label %look
look:
  %psl = {_w(SLEEPERS)}
  %sl = load atomic i64, ptr %psl seq_cst, align 8
  %asleep = icmp sgt i64 %sl, 0
  br i1 %asleep, label %lock, label %exit
lock:
  %po = {_w(OWNER)}
  %lk = cmpxchg ptr %po, i64 0, i64 1 acquire monotonic
  %got = extractvalue {{ i64, i1 }} %lk, 1
  br i1 %got, label %bump, label %exit
bump:
  %pseq = {_w(SEQ)}
  %s = load atomic i32, ptr %pseq monotonic, align 8
  %s1 = add i32 %s, 1
  store atomic i32 %s1, ptr %pseq seq_cst, align 8
  %w = call i64 (i64, ...) @syscall(i64 {futex}, ptr %pseq, i64 129, i64 2147483647)
  store atomic i64 0, ptr %po release, align 8
  %trace = load atomic ptr, ptr @kiln_team_trace monotonic, align 8
  %tracing = icmp ne ptr %trace, null
  br i1 %tracing, label %record, label %exit
record:
  %tw = call i64 @team_now()
  call void @team_record(ptr %trace, i64 %tw, i64 %tw, i64 %tw, i64 0, i64 0, i64 0, i64 {WAKE_KIND}, i64 0)
  br label %exit
exit:
  ret void
}}

; make %t the team regions run on (null: none, every region serial)
define void @kiln_team_publish(ptr %t) {{
entry:
  store atomic ptr %t, ptr @kiln_team_ptr seq_cst, align 8
  ret void
}}

; stop the workers of team %t (they return from kiln_team_worker)
define void @kiln_team_stop(ptr %t) {{
entry:
  %pstop = {_w(STOP)}
  store atomic i64 1, ptr %pstop seq_cst, align 8
  %pseq = {_w(SEQ)}
  %s = atomicrmw add ptr %pseq, i32 1 seq_cst
  %w = call i64 (i64, ...) @syscall(i64 {futex}, ptr %pseq, i64 129, i64 2147483647)
  ret void
}}
"""
