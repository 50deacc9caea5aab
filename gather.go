package cudaipc

import (
	"fmt"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Device gather: many device-to-device copies as one kernel launch. A
// copy engine pays a start and a drain for each copy (microseconds), which
// thousands of small copies (a KV cache's blocks) turn into most of the
// time; a kernel copies them all at once. The copies are cut into chunks
// of at most gatherChunk bytes, one thread block each, listed in a table
// of (destination, source, bytes) in page-locked host memory the kernel
// reads across the bus (24 bytes a block). Each block copies 16 bytes a
// thread at a time where both addresses are 16-byte aligned, and its tail
// (or a misaligned chunk) a byte at a time. The Python client's kernel
// (python/cudaipc/_gather.py) is the same.

// gatherChunk is the most bytes one thread block copies.
const gatherChunk = 128 << 10

const gatherThreads = 256

// gatherPTX is the kernel. Parameters: the table (its device address) and
// the number of its rows. python/cudaipc/_gather.py carries the same text
// (TestGatherPTXMatchesPython keeps them equal).
const gatherPTX = `.version 7.0
.target sm_70
.address_size 64

.visible .entry cudaipc_gather(
	.param .u64 tab,
	.param .u64 nchunks
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<8>;
	.reg .b64 %rd<24>;

	ld.param.u64 %rd1, [tab];
	ld.param.u64 %rd2, [nchunks];
	mov.u32 %r1, %ctaid.x;
	cvt.u64.u32 %rd3, %r1;
	setp.ge.u64 %p1, %rd3, %rd2;
	@%p1 bra DONE;
	mul.lo.u64 %rd4, %rd3, 24;
	add.u64 %rd5, %rd1, %rd4;
	cvta.to.global.u64 %rd5, %rd5;
	ld.global.u64 %rd6, [%rd5];
	ld.global.u64 %rd7, [%rd5+8];
	ld.global.u64 %rd8, [%rd5+16];
	cvta.to.global.u64 %rd6, %rd6;
	cvta.to.global.u64 %rd7, %rd7;
	mov.u32 %r2, %tid.x;
	cvt.u64.u32 %rd9, %r2;
	mov.u32 %r3, %ntid.x;
	cvt.u64.u32 %rd10, %r3;
	or.b64 %rd11, %rd6, %rd7;
	and.b64 %rd11, %rd11, 15;
	setp.ne.u64 %p2, %rd11, 0;
	mov.u64 %rd12, 0;
	@%p2 bra TAIL;
	and.b64 %rd12, %rd8, -16;
	shl.b64 %rd13, %rd9, 4;
	shl.b64 %rd14, %rd10, 4;
VEC:
	setp.ge.u64 %p3, %rd13, %rd12;
	@%p3 bra TAIL;
	add.u64 %rd15, %rd7, %rd13;
	add.u64 %rd16, %rd6, %rd13;
	ld.global.v4.u32 {%r4, %r5, %r6, %r7}, [%rd15];
	st.global.v4.u32 [%rd16], {%r4, %r5, %r6, %r7};
	add.u64 %rd13, %rd13, %rd14;
	bra VEC;
TAIL:
	add.u64 %rd17, %rd12, %rd9;
BYTE:
	setp.ge.u64 %p3, %rd17, %rd8;
	@%p3 bra DONE;
	add.u64 %rd18, %rd7, %rd17;
	add.u64 %rd19, %rd6, %rd17;
	ld.global.u8 %r4, [%rd18];
	st.global.u8 [%rd19], %r4;
	add.u64 %rd17, %rd17, %rd10;
	bra BYTE;
DONE:
	ret;
}
`

// Copy is one copy of Gather: Bytes bytes from Src to Dst.
type Copy struct {
	Dst, Src DevicePtr
	Bytes    int64
}

// gatherKernel is a device's loaded kernel and the scratch of its calls,
// kept for the process's life.
type gatherKernel struct {
	fn      cu.Function
	scratch chan *gatherScratch
}

// gatherScratches bounds the calls of one device that run at once (the
// others wait for a scratch).
const gatherScratches = 16

// gatherScratch is one call's stream, its events (one a group) and its
// table (page-locked words, and their device address).
type gatherScratch struct {
	stream cu.Stream
	events []cu.Event
	words  []uint32
	table  cu.DevicePtr
}

func (d *Device) gatherKernel() (*gatherKernel, error) {
	d.gatherOnce.Do(func() {
		k := &gatherKernel{scratch: make(chan *gatherScratch, gatherScratches)}
		for range gatherScratches {
			k.scratch <- &gatherScratch{}
		}
		d.gatherErr = d.do(func() error {
			if !cu.Has("cuMemHostGetDevicePointer") {
				return fmt.Errorf("the driver lacks cuMemHostGetDevicePointer_v2")
			}
			m, err := cu.ModuleLoadData([]byte(gatherPTX))
			if err != nil {
				return fmt.Errorf("load the gather kernel: %w", err)
			}
			k.fn, err = cu.ModuleGetFunction(m, "cudaipc_gather")
			return err
		})
		if d.gatherErr != nil {
			d.gatherErr = fmt.Errorf("cudaipc: %s: %w", d, d.gatherErr)
			return
		}
		d.gather = k
	})
	return d.gather, d.gatherErr
}

// Gather copies groups of device-to-device copies, one kernel launch a
// group, in order on a stream of its own (which does not wait for other
// streams: the sources must be written when it is called), and calls
// done(i), when done is not nil, once every copy of group i is complete.
// It returns when all are, or at the first error. Sources and
// destinations are device addresses in this process that d's context
// reaches (d's memory, or memory mapped for d); copies of a group must not
// overlap. Safe for concurrent use.
func (d *Device) Gather(groups [][]Copy, done func(int)) error {
	var rows uint64
	for i, g := range groups {
		for j, c := range g {
			if c.Bytes < 0 || c.Bytes > 0 && (c.Dst == 0 || c.Src == 0) {
				return &ArgError{Op: "Gather", Arg: "groups", Reason: fmt.Sprintf("group %d copy %d: %d bytes from %#x to %#x", i, j, c.Bytes, uint64(c.Src), uint64(c.Dst))}
			}
			rows += uint64((c.Bytes + gatherChunk - 1) / gatherChunk)
		}
	}
	k, err := d.gatherKernel()
	if err != nil {
		return err
	}
	s := <-k.scratch
	defer func() { k.scratch <- s }() // its stream is idle: every call waits for its work
	var next int
	err = d.do(func() error {
		if err := s.grow(rows, len(groups)); err != nil {
			return err
		}
		row := uint64(0)
		for i, g := range groups {
			first := row
			for _, c := range g {
				for off := int64(0); off < c.Bytes; off += gatherChunk {
					n := min(c.Bytes-off, gatherChunk)
					w := s.words[6*row:]
					put64(w[0:], uint64(c.Dst)+uint64(off))
					put64(w[2:], uint64(c.Src)+uint64(off))
					put64(w[4:], uint64(n))
					row++
				}
			}
			if n := row - first; n > 0 {
				if n > 1<<31-1 {
					return fmt.Errorf("group %d: %d chunks, at most %d", i, n, 1<<31-1)
				}
				if err := cu.LaunchKernel(k.fn, [3]uint32{uint32(n), 1, 1}, [3]uint32{gatherThreads, 1, 1}, 0, s.stream,
					uint64(s.table)+24*first, n); err != nil {
					return err
				}
			}
			if err := cu.EventRecord(s.events[i], s.stream); err != nil {
				return err
			}
		}
		for ; next < len(groups); next++ {
			if err := cu.EventSynchronize(s.events[next]); err != nil {
				return err
			}
			if done != nil {
				done(next)
			}
		}
		return nil
	})
	if err != nil {
		// Whatever was queued must end before the table is reused.
		_ = d.do(func() error { return cu.StreamSynchronize(s.stream) })
		return fmt.Errorf("cudaipc: Gather on %s, group %d of %d: %w", d, next, len(groups), err)
	}
	return nil
}

// grow makes room for rows rows and groups events.
func (s *gatherScratch) grow(rows uint64, groups int) error {
	if s.stream == 0 {
		st, err := cu.StreamCreate(cu.StreamNonBlocking)
		if err != nil {
			return err
		}
		s.stream = st
	}
	for len(s.events) < groups {
		// Waiting blocks the thread instead of spinning a CPU.
		e, err := cu.EventCreate(cu.EventBlockingSync | cu.EventDisableTiming)
		if err != nil {
			return err
		}
		s.events = append(s.events, e)
	}
	if uint64(len(s.words)) < 6*rows {
		if s.words != nil {
			if err := cu.MemFreeHostWords(s.words); err != nil {
				return err
			}
			s.words, s.table = nil, 0
		}
		w, p, err := cu.MemAllocHostWords(max(6*rows, 6<<10))
		if err != nil {
			return err
		}
		s.words, s.table = w, p
	}
	return nil
}

func put64(w []uint32, v uint64) { w[0], w[1] = uint32(v), uint32(v>>32) }
