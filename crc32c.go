package cudaipc

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"math/bits"
	"sync"

	"github.com/cudaipc/cudaipc/internal/cu"
)

// Device CRC-32C: the device computes the CRC of each block of a range (a
// kernel of this package, PTX the driver compiles once per device), and
// the host combines the blocks' CRCs into each chunk's, the same value
// hash/crc32 gives for the bytes (Castagnoli). A GPU object's chunk
// checksums then cost the host no pass over its bytes: a node seals and
// checks a GPU object's chunks where they are, in device memory.
//
// The kernel: thread i computes the raw CRC (register 0 at the start, no
// final inversion) of block i, bytes [i·B, min((i+1)·B, n)), 16 bytes a
// load, a 4-byte word at a time by slicing-by-4 (crcTables, in shared
// memory: four lookups that do not wait for each other, where a byte at a
// time chains four), a tail shorter than 16 bytes a byte at a time.
// For the host: with raw(c, p) the CRC register after p from c,
// raw(c, a‖b) = shift_|b|(raw(c, a)) ⊕ raw(0, b), where shift_L(c) =
// raw(c, L zero bytes) is linear in c (one table per byte of c), and
// crc32.Checksum(p) = ^raw(0xFFFFFFFF, p).

// castagnoli is hash/crc32's reflected Castagnoli table, the kernel's.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// crcTables are the kernel's slicing-by-4 tables: [0] is castagnoli (a
// byte's step), [k][i] the register after byte i and k zero bytes. For a
// word w (little-endian) the register c becomes, with x = c ⊕ w,
// [3][x&255] ⊕ [2][x>>8&255] ⊕ [1][x>>16&255] ⊕ [0][x>>24].
var crcTables = func() (t [4][256]uint32) {
	t[0] = *castagnoli
	for k := 1; k < 4; k++ {
		for i := range 256 {
			v := t[k-1][i]
			t[k][i] = v>>8 ^ t[0][v&255]
		}
	}
	return t
}()

// crcMinBlock and crcMaxBlock bound the kernel's block: small enough for
// a few tens of thousands of threads over a 4 MiB chunk, large enough that
// combining the blocks' CRCs costs the host little against the bytes.
const (
	crcMinBlock = 256
	crcMaxBlock = 16 << 10
	crcThreads  = 256 // threads a CTA: the kernel loads its tables with them
)

// crcBlockFor returns the block for n bytes cut in chunks of chunk bytes:
// a power of two dividing chunk, about n/32768, within the bounds.
func crcBlockFor(n, chunk int64) int64 {
	b := int64(crcMinBlock)
	for b < crcMaxBlock && b*2 <= n/32768 && chunk%(b*2) == 0 {
		b *= 2
	}
	return b
}

// crcShift is the operator shift_L for one L: four tables, one per byte
// of the register.
type crcShift [4][256]uint32

// raw advances the CRC register c over p (no inversions).
func crcRaw(c uint32, p []byte) uint32 { return ^crc32.Update(^c, castagnoli, p) }

func newCRCShift(l int64) *crcShift {
	zeros := make([]byte, l)
	var col [32]uint32
	for b := range 32 {
		col[b] = crcRaw(1<<b, zeros)
	}
	var s crcShift
	for k := range 4 {
		for v := range 256 {
			var x uint32
			for i := range 8 {
				if v&(1<<i) != 0 {
					x ^= col[8*k+i]
				}
			}
			s[k][v] = x
		}
	}
	return &s
}

func (s *crcShift) apply(c uint32) uint32 {
	return s[0][c&0xff] ^ s[1][c>>8&0xff] ^ s[2][c>>16&0xff] ^ s[3][c>>24]
}

var crcShifts sync.Map // int64 → *crcShift

func crcShiftFor(l int64) *crcShift {
	if s, ok := crcShifts.Load(l); ok {
		return s.(*crcShift)
	}
	s := newCRCShift(l)
	if l >= crcMinBlock && l&(l-1) == 0 { // keep the blocks' operators, not each tail's
		crcShifts.Store(l, s)
	}
	return s
}

// combineCRC32C returns the CRC-32C of each chunk of n bytes given raw,
// the raw CRCs of their blocks of block bytes (the last block of the n
// bytes shorter when block does not divide n); chunk is a multiple of
// block.
func combineCRC32C(raw []uint32, n, block, chunk int64) []uint32 {
	full := crcShiftFor(block)
	var tail *crcShift
	if r := n % block; r != 0 {
		tail = crcShiftFor(r)
	}
	per := chunk / block
	sums := make([]uint32, 0, (n+chunk-1)/chunk)
	for first := int64(0); first < int64(len(raw)); first += per {
		c := uint32(0xFFFFFFFF)
		for j := first; j < min(first+per, int64(len(raw))); j++ {
			s := full
			if tail != nil && j == int64(len(raw))-1 {
				s = tail
			}
			c = s.apply(c) ^ raw[j]
		}
		sums = append(sums, ^c)
	}
	return sums
}

// crcPTX is the kernel. Parameters: data (16-byte aligned), n, tables
// (crcTables: 1024 words), out (a word a block), shift (log2 of the
// block). It runs crcThreads threads a CTA, each loading four words of the
// tables into shared memory.
var crcPTX = func() string {
	// step: a byte already xored into %r10, through crcTables[0].
	step := `	and.b32 %r16, %r10, 255;
	shl.b32 %r16, %r16, 2;
	add.s32 %r16, %r3, %r16;
	ld.shared.u32 %r17, [%r16];
	shr.u32 %r10, %r10, 8;
	xor.b32 %r10, %r10, %r17;
`
	// word: a 4-byte word, through the four of crcTables at once.
	word := func(r string) string {
		return "\txor.b32 %r10, %r10, " + r + ";\n" + `	and.b32 %r16, %r10, 255;
	shl.b32 %r16, %r16, 2;
	add.s32 %r16, %r3, %r16;
	ld.shared.u32 %r17, [%r16+3072];
	bfe.u32 %r18, %r10, 8, 8;
	shl.b32 %r18, %r18, 2;
	add.s32 %r18, %r3, %r18;
	ld.shared.u32 %r19, [%r18+2048];
	bfe.u32 %r20, %r10, 16, 8;
	shl.b32 %r20, %r20, 2;
	add.s32 %r20, %r3, %r20;
	ld.shared.u32 %r21, [%r20+1024];
	shr.u32 %r22, %r10, 24;
	shl.b32 %r22, %r22, 2;
	add.s32 %r22, %r3, %r22;
	ld.shared.u32 %r23, [%r22];
	xor.b32 %r10, %r17, %r19;
	xor.b32 %r10, %r10, %r21;
	xor.b32 %r10, %r10, %r23;
`
	}
	return `.version 7.0
.target sm_70
.address_size 64

.visible .entry cudaipc_crc32c_blocks(
	.param .u64 p_data,
	.param .u64 p_n,
	.param .u64 p_table,
	.param .u64 p_out,
	.param .u32 p_shift
)
{
	.reg .pred %p<4>;
	.reg .b32 %r<24>;
	.reg .b64 %rd<24>;
	.shared .align 4 .b32 tab[1024];

	mov.u32 %r1, %tid.x;
	ld.param.u64 %rd1, [p_table];
	cvta.to.global.u64 %rd1, %rd1;
	mul.wide.u32 %rd2, %r1, 4;
	add.s64 %rd3, %rd1, %rd2;
	ld.global.u32 %r2, [%rd3];
	mov.u32 %r3, tab;
	shl.b32 %r4, %r1, 2;
	add.s32 %r5, %r3, %r4;
	st.shared.u32 [%r5], %r2;
	ld.global.u32 %r2, [%rd3+1024];
	st.shared.u32 [%r5+1024], %r2;
	ld.global.u32 %r2, [%rd3+2048];
	st.shared.u32 [%r5+2048], %r2;
	ld.global.u32 %r2, [%rd3+3072];
	st.shared.u32 [%r5+3072], %r2;
	bar.sync 0;

	mov.u32 %r6, %ctaid.x;
	mov.u32 %r7, %ntid.x;
	mul.wide.u32 %rd4, %r6, %r7;
	cvt.u64.u32 %rd5, %r1;
	add.s64 %rd6, %rd4, %rd5;
	ld.param.u32 %r8, [p_shift];
	shl.b64 %rd7, %rd6, %r8;
	ld.param.u64 %rd8, [p_n];
	setp.ge.u64 %p1, %rd7, %rd8;
	@%p1 bra DONE;
	mov.u64 %rd9, 1;
	shl.b64 %rd9, %rd9, %r8;
	add.s64 %rd10, %rd7, %rd9;
	min.u64 %rd10, %rd10, %rd8;
	ld.param.u64 %rd11, [p_data];
	cvta.to.global.u64 %rd11, %rd11;
	add.s64 %rd12, %rd11, %rd7;
	sub.s64 %rd13, %rd10, %rd7;
	shr.u64 %rd14, %rd13, 4;
	shl.b64 %rd14, %rd14, 4;
	add.s64 %rd15, %rd12, %rd14;
	add.s64 %rd16, %rd11, %rd10;
	mov.u32 %r10, 0;
V16:
	setp.ge.u64 %p2, %rd12, %rd15;
	@%p2 bra TAIL;
	ld.global.nc.v4.u32 {%r11, %r12, %r13, %r14}, [%rd12];
` + word("%r11") + word("%r12") + word("%r13") + word("%r14") + `	add.s64 %rd12, %rd12, 16;
	bra.uni V16;
TAIL:
	setp.ge.u64 %p3, %rd12, %rd16;
	@%p3 bra STORE;
	ld.global.nc.u8 %r15, [%rd12];
	xor.b32 %r10, %r10, %r15;
` + step + `	add.s64 %rd12, %rd12, 1;
	bra.uni TAIL;
STORE:
	ld.param.u64 %rd17, [p_out];
	cvta.to.global.u64 %rd17, %rd17;
	shl.b64 %rd18, %rd6, 2;
	add.s64 %rd19, %rd17, %rd18;
	st.global.u32 [%rd19], %r10;
DONE:
	ret;
}
`
}()

// crcKernel is a device's loaded kernel, its tables in device memory, and
// scratch for calls (a stream and a buffer for the blocks' CRCs each).
type crcKernel struct {
	fn      cu.Function
	table   cu.DevicePtr
	scratch chan *crcScratch
}

// crcScratch is one call's stream and the words the kernel writes its
// blocks' CRCs into: page-locked host memory the kernel stores to across
// the bus (cu.MemAllocHostWords), so that reading them takes no copy. A
// copy back (a small device→host copy after every chunk a pull lands)
// would queue on the device→host copy engine behind other processes'
// large copies, such as a holder's staging on the same GPU.
type crcScratch struct {
	stream cu.Stream
	// done marks the end of the call's work on stream; waiting for it
	// blocks the thread (EventBlockingSync) where StreamSynchronize would
	// spin on a CPU under the primary context's default scheduling, a CPU
	// the host's socket copies need beside a pull.
	done cu.Event
	out  cu.DevicePtr // host, as the kernel addresses it
	host []uint32
}

// crcScratches bounds the calls of one device that run at once (the
// others wait for a scratch).
const crcScratches = 16

func (d *Device) crcKernel() (*crcKernel, error) {
	d.crcOnce.Do(func() {
		d.crc, d.crcErr = d.loadCRCKernel()
	})
	return d.crc, d.crcErr
}

func (d *Device) loadCRCKernel() (*crcKernel, error) {
	k := &crcKernel{scratch: make(chan *crcScratch, crcScratches)}
	err := d.do(func() error {
		if !cu.Has("cuMemHostGetDevicePointer") {
			// Where the kernel writes its sums (crcScratch): without it
			// every call would fail, so the device reports no support.
			return errors.New("the driver lacks cuMemHostGetDevicePointer_v2")
		}
		m, err := cu.ModuleLoadData([]byte(crcPTX))
		if err != nil {
			return fmt.Errorf("load the CRC-32C kernel: %w", err)
		}
		if k.fn, err = cu.ModuleGetFunction(m, "cudaipc_crc32c_blocks"); err != nil {
			return fmt.Errorf("find the CRC-32C kernel: %w", err)
		}
		if k.table, err = cu.MemAlloc(4 * 256 * 4); err != nil {
			return err
		}
		tab := make([]byte, 0, 4*256*4)
		for _, t := range crcTables {
			for _, v := range t {
				tab = binary.LittleEndian.AppendUint32(tab, v)
			}
		}
		if err := cu.MemcpyHtoD(k.table, tab); err != nil {
			return err
		}
		return settle()
	})
	if err != nil {
		return nil, fmt.Errorf("cudaipc: %s: %w", d, err)
	}
	for range crcScratches {
		k.scratch <- &crcScratch{}
	}
	return k, nil
}

// CRC32CSupported reports whether the device computes CRC-32C
// (ChunkCRC32C): whether the driver loaded this package's kernel for it
// (once; later calls return the first answer), and the error if not.
func (d *Device) CRC32CSupported() error {
	_, err := d.crcKernel()
	return err
}

// ChunkCRC32C returns the CRC-32C (Castagnoli, crc32.Checksum's value) of
// each chunk of the n bytes of device memory at p: chunk bytes each, the
// last one shorter. The device reads the bytes (a kernel on a stream of
// its own, which does not wait for the legacy default stream: the bytes
// must be in place when it is called) and the host combines a word per
// block of 256 B–16 KiB. p must be 16-byte aligned and chunk a multiple
// of 256; n 0 gives no sums. Safe for concurrent use.
func (d *Device) ChunkCRC32C(p DevicePtr, n, chunk int64) ([]uint32, error) {
	if n < 0 {
		return nil, &ArgError{Op: "ChunkCRC32C", Arg: "n", Reason: "negative"}
	}
	return d.sumChunks("ChunkCRC32C", p, n, chunk, nil)
}

// CopyToDeviceCRC32C copies src to device address dst, as CopyToDevice
// does, and returns the CRC-32C of each chunk of the bytes as they landed
// in device memory (ChunkCRC32C's values). The copy, the kernel and the
// sums' copy back run on one stream of the kernel's own and the call
// waits for that stream alone: unlike CopyToDevice followed by
// ChunkCRC32C, it never queues behind other copies on the legacy default
// stream, so concurrent calls (a pull landing chunks on several
// goroutines) overlap one another's copies and kernels. With src in
// page-locked memory (AllocHost) the copy is a direct DMA. dst must be
// 16-byte aligned and chunk a multiple of 256; an empty src copies
// nothing and gives no sums. Safe for concurrent use.
func (d *Device) CopyToDeviceCRC32C(dst DevicePtr, src []byte, chunk int64) ([]uint32, error) {
	if len(src) == 0 {
		return d.sumChunks("CopyToDeviceCRC32C", dst, 0, chunk, nil)
	}
	return d.sumChunks("CopyToDeviceCRC32C", dst, int64(len(src)), chunk, func(st cu.Stream) error {
		return cu.MemcpyHtoDAsync(cu.DevicePtr(dst), src, st)
	})
}

// sumChunks checksums the n bytes at p in chunks on one of the kernel's
// scratch streams, after before (when not nil) has queued its work there.
func (d *Device) sumChunks(op string, p DevicePtr, n, chunk int64, before func(cu.Stream) error) ([]uint32, error) {
	switch {
	case chunk <= 0 || chunk%crcMinBlock != 0:
		return nil, &ArgError{Op: op, Arg: "chunk", Reason: fmt.Sprintf("%d is not a positive multiple of %d", chunk, crcMinBlock)}
	case p%16 != 0:
		return nil, &ArgError{Op: op, Arg: "p", Reason: fmt.Sprintf("%#x is not 16-byte aligned", uint64(p))}
	case n == 0:
		return nil, nil
	}
	k, err := d.crcKernel()
	if err != nil {
		return nil, err
	}
	block := crcBlockFor(n, chunk)
	blocks := (n + block - 1) / block
	s := <-k.scratch
	defer func() { k.scratch <- s }()
	err = d.do(func() error {
		if s.stream == 0 {
			st, err := cu.StreamCreate(cu.StreamNonBlocking)
			if err != nil {
				return err
			}
			s.stream = st
		}
		if s.done == 0 {
			e, err := cu.EventCreate(cu.EventBlockingSync | cu.EventDisableTiming)
			if err != nil {
				return err
			}
			s.done = e
		}
		if int64(len(s.host)) < blocks {
			if s.host != nil {
				if err := cu.MemFreeHostWords(s.host); err != nil {
					return err
				}
				s.host, s.out = nil, 0
			}
			host, out, err := cu.MemAllocHostWords(uint64(max(blocks, 16<<10)))
			if err != nil {
				return err
			}
			s.host, s.out = host, out
		}
		ctas := (blocks + crcThreads - 1) / crcThreads
		if ctas > 1<<31-1 {
			return fmt.Errorf("%d bytes need %d thread blocks", n, ctas)
		}
		if before != nil {
			if err := before(s.stream); err != nil {
				return err
			}
		}
		shift := uint64(bits.TrailingZeros64(uint64(block)))
		if err := cu.LaunchKernel(k.fn, [3]uint32{uint32(ctas), 1, 1}, [3]uint32{crcThreads, 1, 1}, 0, s.stream,
			uint64(p), uint64(n), uint64(k.table), uint64(s.out), shift); err != nil {
			return err
		}
		// The kernel's stores reach s.host once the stream is done.
		if err := cu.EventRecord(s.done, s.stream); err != nil {
			return err
		}
		return cu.EventSynchronize(s.done)
	})
	if err != nil {
		return nil, fmt.Errorf("cudaipc: %s of %d bytes on %s: %w", op, n, d, err)
	}
	return combineCRC32C(s.host[:blocks], n, block, chunk), nil
}
