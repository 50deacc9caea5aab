package store

import (
	"bytes"
	"encoding/binary"
	"math"
	"math/big"
	"os"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// doFiles sends a request with descriptors attached and returns its
// response.
func (rc *rawClient) doFiles(r *storev1.Request, files ...*os.File) (*storev1.Response, []*os.File) {
	rc.t.Helper()
	rc.id++
	r.Id = rc.id
	if err := rc.c.Send(r, files...); err != nil {
		rc.t.Fatal(err)
	}
	return rc.recv(rc.id)
}

// memfd returns a sealable memfd of size bytes holding data.
func memfd(t testing.TB, size int, data []byte) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("pool-test", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "pool-test")
	t.Cleanup(func() { f.Close() })
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	return f
}

func u32s(vs ...uint32) []byte {
	b := make([]byte, 4*len(vs))
	for i, v := range vs {
		binary.LittleEndian.PutUint32(b[4*i:], v)
	}
	return b
}

func blockPutReq(pool string, keys []byte, count uint32, src *storev1.BlockSource) *storev1.Request {
	return &storev1.Request{Body: &storev1.Request_BlockPut{BlockPut: &storev1.BlockPutRequest{Pool: pool, Count: count, Keys: &storev1.Blob{Data: keys}, Source: src}}}
}

// TestPoolBadRequests sends malformed and refused pool requests over the
// wire: each is answered with its code, stores nothing, and leaves the
// connection usable; a good put after them is read back byte for byte
// through the pool's memory.
func TestPoolBadRequests(t *testing.T) {
	_, path, _ := serve(t, Config{})
	rc := dialRaw(t, path)
	const blockBytes = 96 // two parts of 48 bytes
	src := randomBytes(16 * 100)
	resp, _ := rc.doFiles(&storev1.Request{Body: &storev1.Request_Register{Register: &storev1.RegisterRequest{
		Name: "space/0", Size: uint64(len(src)), Device: "host", Files: 1, Space: []byte("desc")}}}, memfd(t, len(src), src))
	wantCode(t, resp, storev1.Error_OK)
	rc.put("plain", 4096, false)

	create := func(c *storev1.PoolCreateRequest) *storev1.Response {
		resp, _ := rc.do(&storev1.Request{Body: &storev1.Request_PoolCreate{PoolCreate: c}})
		return resp
	}
	for _, c := range []struct {
		req  *storev1.PoolCreateRequest
		want storev1.Error_Code
	}{
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 96, KeyBytes: 8, Capacity: 1 << 20}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 0, KeyBytes: 16, Capacity: 1 << 20}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 1 << 31, KeyBytes: 16, Capacity: 1 << 40}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 300, KeyBytes: 16, Capacity: 511}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 96, KeyBytes: 16, Capacity: 1 << 20, Device: "GPU-00000000-0000-0000-0000-000000000000"}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "65534:p", BlockBytes: 96, KeyBytes: 16, Capacity: 1 << 20}, storev1.Error_PERMISSION},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: 96, KeyBytes: 16, Capacity: 1 << 41}, storev1.Error_INVALID},
		{&storev1.PoolCreateRequest{Name: "big", BlockBytes: 4096, KeyBytes: 16, Capacity: 2 << 30}, storev1.Error_STORE_FULL},
		{&storev1.PoolCreateRequest{Name: "c", BlockBytes: 96, KeyBytes: 16, Capacity: 1 << 20, Cluster: true}, storev1.Error_INVALID}, // no cluster
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: blockBytes, KeyBytes: 16, Capacity: 8 * 256}, storev1.Error_OK},
		{&storev1.PoolCreateRequest{Name: "p", BlockBytes: blockBytes, KeyBytes: 16, Capacity: 8 * 256}, storev1.Error_EXISTS},
	} {
		if got := create(c.req); code(got) != c.want {
			t.Fatalf("pool_create %v: %v (%s), want %v", c.req, code(got), got.GetError().GetMessage(), c.want)
		}
	}

	keys := bytes.Repeat([]byte{7}, 16)
	keys[0] = 1
	keys2 := append(bytes.Clone(keys), keys...)
	keys2[16] = 2
	good := func() *storev1.BlockSource {
		return &storev1.BlockSource{Regions: []string{"space/0"}, Ids: &storev1.Blob{Data: u32s(3, 5)},
			Parts: []*storev1.BlockPart{{Region: 0, Base: 0, Stride: 96, Bytes: 48}, {Region: 0, Base: 48, Stride: 96, Bytes: 48}}}
	}
	pipeR, pipeW, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pipeR.Close()
	defer pipeW.Close()
	small := memfd(t, 64, nil)
	for _, c := range []struct {
		name string
		req  *storev1.Request
		file *os.File
		want storev1.Error_Code
	}{
		{"unknown pool", blockPutReq("nope", keys2, 2, good()), nil, storev1.Error_NOT_FOUND},
		{"keys of another size", blockPutReq("p", bytes.Repeat([]byte{1}, 40), 2, good()), nil, storev1.Error_INVALID},
		{"keys not a multiple", blockPutReq("p", bytes.Repeat([]byte{1}, 33), 2, good()), nil, storev1.Error_INVALID},
		{"ids for one key", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Ids.Data = u32s(1); return s }()), nil, storev1.Error_INVALID},
		{"part of no region", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Parts[1].Region = 1; return s }()), nil, storev1.Error_INVALID},
		{"part past the region", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Ids.Data = u32s(3, 16); return s }()), nil, storev1.Error_INVALID},
		{"stride that overflows", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Parts[0].Stride = math.MaxUint64 / 2; return s }()), nil, storev1.Error_INVALID},
		{"base past the region", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Parts[0].Base = math.MaxUint64; return s }()), nil, storev1.Error_INVALID},
		{"parts of another block size", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Parts[1].Bytes = 40; return s }()), nil, storev1.Error_INVALID},
		{"no such source", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Regions[0] = "space/9"; return s }()), nil, storev1.Error_NOT_FOUND},
		{"a source that is an object", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Regions[0] = "plain"; return s }()), nil, storev1.Error_NOT_FOUND},
		{"another space", blockPutReq("p", keys2, 2, func() *storev1.BlockSource { s := good(); s.Space = []byte("other"); return s }()), nil, storev1.Error_NOT_FOUND},
		{"no source", blockPutReq("p", keys2, 2, nil), nil, storev1.Error_INVALID},
		{"a bulk file that is a pipe", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Length: 16}}}}, pipeR, storev1.Error_INVALID},
		{"a span past the bulk file", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Offset: 60, Length: 16}}}}, small, storev1.Error_INVALID},
		{"a span past 64 MiB", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Offset: math.MaxUint64 - 4, Length: 16}}}}, small, storev1.Error_INVALID},
		{"inline keys with a bulk file", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Data: keys}}}}, small, storev1.Error_INVALID},
		{"a span without a bulk file", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Length: 16}}}}, nil, storev1.Error_INVALID},
		{"no keys", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p"}}}, nil, storev1.Error_INVALID},
		{"a pin timeout too long", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Data: keys}, Pin: true, PinTimeoutMs: protocol.MaxPinTimeoutMs + 1}}}, nil, storev1.Error_INVALID},
		{"a negative pin timeout", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Data: keys}, PinTimeoutMs: -1}}}, nil, storev1.Error_INVALID},
		{"a bitmap past 64 MiB", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Length: 16}, PerKey: true, Pin: true, PresentAt: protocol.MaxBulkSize}}}, small, storev1.Error_INVALID},
		{"a cluster timeout too long", &storev1.Request{Body: &storev1.Request_BlockGet{BlockGet: &storev1.BlockGetRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Data: keys}, TimeoutMs: protocol.MaxPoolTimeoutMs + 1}}}, nil, storev1.Error_INVALID},
		{"a negative cluster timeout", &storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Data: keys}, TimeoutMs: -1}}}, nil, storev1.Error_INVALID},
		{"unpin 0", &storev1.Request{Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{}}}, nil, storev1.Error_INVALID},
		{"unpin of no pin", &storev1.Request{Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{Pin: 77}}}, nil, storev1.Error_NOT_FOUND},
		{"evict 0", &storev1.Request{Body: &storev1.Request_BlockEvict{BlockEvict: &storev1.BlockEvictRequest{Pool: "p"}}}, nil, storev1.Error_INVALID},
		{"get of no pool", &storev1.Request{Body: &storev1.Request_BlockGet{BlockGet: &storev1.BlockGetRequest{Pool: "q", Count: 1, Keys: &storev1.Blob{Data: keys}}}}, nil, storev1.Error_NOT_FOUND},
		{"stat of no pool", &storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: "q", Map: true}}}, nil, storev1.Error_NOT_FOUND},
	} {
		var files []*os.File
		if c.file != nil {
			files = append(files, c.file)
		}
		resp, got := rc.doFiles(c.req, files...)
		protocol.CloseFiles(got)
		if code(resp) != c.want {
			t.Fatalf("%s: %v (%s), want %v", c.name, code(resp), resp.GetError().GetMessage(), c.want)
		}
	}
	stat := func() *storev1.PoolInfo {
		resp, files := rc.do(&storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: "p"}}})
		wantCode(t, resp, storev1.Error_OK)
		protocol.CloseFiles(files)
		return resp.GetPoolStat().GetInfo()
	}
	if in := stat(); in.GetBlocks() != 0 || in.GetWriting() != 0 || in.GetStored() != 0 {
		t.Fatalf("after refused puts: %v", in)
	}

	// A good put, in a bulk file, and a get: the blocks in the pool's
	// memory are the source's parts end to end.
	bulk := memfd(t, 4096, nil)
	if _, err := bulk.WriteAt(keys2, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := bulk.WriteAt(u32s(3, 5), 64); err != nil {
		t.Fatal(err)
	}
	s := good()
	s.Ids = &storev1.Blob{Offset: 64, Length: 8}
	s.Space = []byte("desc")
	resp, _ = rc.doFiles(&storev1.Request{Body: &storev1.Request_BlockPut{BlockPut: &storev1.BlockPutRequest{Pool: "p", Count: 2,
		Keys: &storev1.Blob{Offset: 0, Length: 32}, Source: s, StatusAt: 128}}}, bulk)
	wantCode(t, resp, storev1.Error_OK)
	if p := resp.GetBlockPut(); p.GetStored() != 2 || p.GetStatus().GetOffset() != 128 || p.GetStatus().GetLength() != 2 {
		t.Fatalf("put: %v", p)
	}
	st := make([]byte, 2)
	bulk.ReadAt(st, 128)
	if !bytes.Equal(st, []byte{0, 0}) {
		t.Fatalf("statuses in the bulk file: %v", st)
	}
	resp, _ = rc.do(&storev1.Request{Body: &storev1.Request_BlockGet{BlockGet: &storev1.BlockGetRequest{Pool: "p", Count: 2, Keys: &storev1.Blob{Data: keys2}}}})
	wantCode(t, resp, storev1.Error_OK)
	g := resp.GetBlockGet()
	resp, files := rc.do(&storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: "p", Map: true}}})
	wantCode(t, resp, storev1.Error_OK)
	in := resp.GetPoolStat().GetInfo()
	if len(files) != 1 || in.GetId() != g.GetPoolId() {
		t.Fatalf("pool_stat with map: %d files, %v", len(files), in)
	}
	mem, err := unix.Mmap(int(files[0].Fd()), 0, int(in.GetMemorySize()), unix.PROT_READ, unix.MAP_SHARED)
	protocol.CloseFiles(files)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	for i, id := range []int{3, 5} {
		slot := binary.LittleEndian.Uint32(g.GetSlots().GetData()[4*i:])
		got := mem[int64(slot)*int64(in.GetSlotBytes()):][:blockBytes]
		if !bytes.Equal(got, src[id*96:id*96+96]) {
			t.Fatalf("key %d: the pool's block is not source block %d", i, id)
		}
	}
	if in.GetPinned() != 2 {
		t.Fatalf("pinned %d during the get, want 2", in.GetPinned())
	}
	// The mapping is read-only: the memfd refuses a writable one.
	resp, files = rc.do(&storev1.Request{Body: &storev1.Request_PoolStat{PoolStat: &storev1.PoolStatRequest{Name: "p", Map: true}}})
	if _, err := unix.Mmap(int(files[0].Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		t.Fatal("the pool's memory was mapped writable by a reader")
	}
	protocol.CloseFiles(files)
	_ = resp
	resp, _ = rc.do(&storev1.Request{Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{Pin: g.GetPin()}}})
	wantCode(t, resp, storev1.Error_OK)

	// Two descriptors on a block request break the framing: the connection
	// closes.
	rc.id++
	if err := rc.c.Send(&storev1.Request{Id: rc.id, Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "p", Count: 1, Keys: &storev1.Blob{Length: 16}}}}, small, bulk); err != nil {
		t.Fatal(err)
	}
	var r storev1.Response
	if _, err := rc.c.Recv(&r); err != nil || code(&r) != storev1.Error_INVALID {
		t.Fatalf("two descriptors: %v, %v", &r, err)
	}
	if _, err := rc.c.Recv(&r); err == nil {
		t.Fatalf("the connection stayed open after a framing violation")
	}
}

// TestPoolMemoryAccounting checks that a pool's capacity is taken from
// the device and the uid's quota when it is made, given back when it is
// deleted, and that the metrics count pools, blocks and lookups.
func TestPoolMemoryAccounting(t *testing.T) {
	s, path, _ := serve(t, Config{Capacity: 8 << 20})
	rc := dialRaw(t, path)
	create := func(name string, capacity uint64) *storev1.Response {
		resp, _ := rc.do(&storev1.Request{Body: &storev1.Request_PoolCreate{PoolCreate: &storev1.PoolCreateRequest{Name: name, BlockBytes: 4096, KeyBytes: 32, Capacity: capacity}}})
		return resp
	}
	wantCode(t, create("a", 6<<20), storev1.Error_OK)
	wantCode(t, create("b", 4<<20), storev1.Error_STORE_FULL)
	if !strings.Contains(create("b", 4<<20).GetError().GetMessage(), "KV block pool's memory") {
		t.Errorf("a full store does not say a pool holds its room: %s", create("b", 4<<20).GetError().GetMessage())
	}
	fams, err := s.gatherer.Gather()
	if err != nil {
		t.Fatal(err)
	}
	gauges := map[string]float64{}
	for _, f := range fams {
		if strings.HasPrefix(f.GetName(), "cudaipc_store_kv_pool") && len(f.GetMetric()) > 0 && f.GetMetric()[0].GetGauge() != nil {
			gauges[f.GetName()] = f.GetMetric()[0].GetGauge().GetValue()
		}
	}
	if gauges["cudaipc_store_kv_pools"] != 1 || gauges["cudaipc_store_kv_pool_capacity_bytes"] != 6<<20 {
		t.Fatalf("pool gauges: %v", gauges)
	}
	resp, _ := rc.do(&storev1.Request{Body: &storev1.Request_PoolDelete{PoolDelete: &storev1.PoolDeleteRequest{Name: "a"}}})
	wantCode(t, resp, storev1.Error_OK)
	wantCode(t, create("b", 4<<20), storev1.Error_OK)
	resp, _ = rc.do(&storev1.Request{Body: &storev1.Request_PoolList{PoolList: &storev1.PoolListRequest{}}})
	if l := resp.GetPoolList().GetPools(); len(l) != 1 || l[0].GetName() != "b" || l[0].GetCapacityBlocks() != 1024 {
		t.Fatalf("pool_list: %v", l)
	}
	resp, _ = rc.do(&storev1.Request{Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "b", Count: 2, Keys: &storev1.Blob{Data: make([]byte, 64)}}}})
	wantCode(t, resp, storev1.Error_OK)
	if got := testutilCounter(s.metrics.pools.misses.WithLabelValues("host", "lookup")); got != 2 {
		t.Errorf("lookup misses %v, want 2", got)
	}
	var m dto.Metric
	if err := s.metrics.pools.lookupSeconds.Write(&m); err != nil || m.GetHistogram().GetSampleCount() != 1 {
		t.Errorf("lookup latency: %v, %v", m.GetHistogram(), err)
	}
}

// FuzzCheckParts checks a put's bounds arithmetic: whatever the parts,
// region sizes and block ids, an accepted source reads inside its regions
// (checked with arbitrary precision) and adds up to the block size.
func FuzzCheckParts(f *testing.F) {
	f.Add(uint64(0), uint64(96), uint64(48), uint64(48), uint64(96), uint64(48), uint32(15), uint32(1536), int64(96))
	f.Add(uint64(math.MaxUint64), uint64(1), uint64(1), uint64(0), uint64(0), uint64(95), uint32(1), uint32(4096), int64(96))
	f.Add(uint64(10), uint64(math.MaxUint64/2), uint64(48), uint64(0), uint64(0), uint64(48), uint32(3), uint32(1<<20), int64(96))
	f.Fuzz(func(t *testing.T, base0, stride0, bytes0, base1, stride1, bytes1 uint64, maxID, size uint32, blockBytes int64) {
		if blockBytes <= 0 || bytes0 == 0 || bytes1 == 0 {
			return
		}
		p := &blockPool{blockBytes: blockBytes}
		mems := [][]byte{make([]byte, size%(1<<20)), make([]byte, size/(1<<12))}
		in := []*storev1.BlockPart{{Region: 0, Base: base0, Stride: stride0, Bytes: bytes0}, {Region: 1, Base: base1, Stride: stride1, Bytes: bytes1}}
		parts, err := p.checkParts(in, mems, maxID)
		if err != nil {
			return
		}
		var sum int64
		for i, pt := range parts {
			end := new(big.Int).SetUint64(in[i].GetStride())
			end.Mul(end, big.NewInt(int64(maxID)))
			end.Add(end, new(big.Int).SetUint64(in[i].GetBase()))
			end.Add(end, new(big.Int).SetUint64(in[i].GetBytes()))
			if end.Cmp(big.NewInt(int64(len(mems[pt.region])))) > 0 {
				t.Fatalf("part %d accepted past its region: ends at %v of %d", i, end, len(mems[pt.region]))
			}
			so := pt.base + int64(maxID)*pt.stride
			_ = mems[pt.region][so : so+pt.bytes] // in bounds, or this panics
			sum += pt.bytes
		}
		if sum != blockBytes {
			t.Fatalf("parts of %d bytes accepted for blocks of %d", sum, blockBytes)
		}
	})
}
