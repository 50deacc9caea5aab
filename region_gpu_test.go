package cudaipc_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// regionMsg is what the regionExporter role reports.
type regionMsg struct {
	Region cudaipc.Region          // the whole allocation
	Subs   []cudaipc.Region        // sub-buffers at non-zero offsets, exported by (*Buffer).Export
	Event  cudaipc.EventDescriptor // an IPC event the exporter signals after writes
	Seed   uint64
	Err    string
}

// subRanges are the sub-buffers the exporter exports: odd offsets and
// sizes, one ending at the allocation's end.
func subRanges(size int64) [][2]int64 {
	return [][2]int64{{1<<20 + 17, 4096}, {3 << 20, 1 << 20}, {4096, 1}, {size - 100, 100}}
}

// roleRegionExporter allocates SIZE bytes on the GPU with UUID DEVICE,
// fills them from SEED, exports regions and an event, and obeys commands:
// "realloc" frees the buffer and allocates a new one of the same size
// filled from Seed, "write" rewrites the buffer from Seed on a busy stream
// and signals the event, "exit" exits without freeing.
func roleRegionExporter(p *testutil.Peer) error {
	dev, err := helperDevice()
	if err != nil {
		return p.Send(map[string]string{"Err": err.Error()}) // a zero Region would not marshal
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	ev, err := dev.NewIPCEvent()
	if err != nil {
		return err
	}
	desc, err := ev.Export()
	if err != nil {
		return err
	}
	export := func(seed uint64) (*cudaipc.Buffer, regionMsg, error) {
		buf, err := dev.Alloc(size)
		if err != nil {
			return nil, regionMsg{}, err
		}
		if _, err := buf.WriteAt(testutil.RandomBytes(seed, int(size)), 0); err != nil {
			return nil, regionMsg{}, err
		}
		m := regionMsg{Event: desc, Seed: seed}
		if m.Region, err = buf.Export(0, size); err != nil {
			return nil, regionMsg{}, err
		}
		for _, r := range subRanges(size) {
			s, err := buf.Export(r[0], r[1])
			if err != nil {
				return nil, regionMsg{}, err
			}
			m.Subs = append(m.Subs, s)
		}
		return buf, m, nil
	}
	buf, m, err := export(seed)
	if err != nil {
		return p.Send(map[string]string{"Err": err.Error()}) // a zero Region would not marshal
	}
	if err := p.Send(m); err != nil {
		return err
	}
	late, err := newLateWriter(dev)
	if err != nil {
		return err
	}
	for {
		var c cmd
		if err := p.Recv(&c); err != nil {
			return nil
		}
		switch c.Op {
		case "realloc":
			if err := buf.Free(); err != nil {
				return err
			}
			if buf, m, err = export(c.Seed); err != nil {
				return p.Send(map[string]string{"Err": err.Error()}) // a zero Region would not marshal
			}
			if err := p.Send(m); err != nil {
				return err
			}
		case "write":
			if err := late.write(p, buf.Ptr(), size, c.Seed, ev.Signal); err != nil {
				return err
			}
		case "exit":
			os.Exit(0)
		default:
			return errors.New("unknown command " + c.Op)
		}
	}
}

// roleRegionImporter imports the region in REGION (JSON) and reports the
// bytes' hash and the device it mapped through.
func roleRegionImporter(p *testutil.Peer) error {
	var r cudaipc.Region
	if err := json.Unmarshal([]byte(os.Getenv("REGION")), &r); err != nil {
		return p.Send(map[string]string{"err": err.Error()})
	}
	m, err := cudaipc.Import(r)
	if err != nil {
		return p.Send(map[string]string{"err": err.Error()})
	}
	defer m.Close()
	got := make([]byte, m.Size())
	if _, err := m.ReadAt(got, 0); err != nil {
		return p.Send(map[string]string{"err": err.Error()})
	}
	n, _ := cudaipc.DeviceCount()
	return p.Send(map[string]string{
		"sum": testutil.Sum(got), "uuid": m.Device().UUID().String(),
		"ordinal": strconv.Itoa(m.Device().Ordinal()), "visible": strconv.Itoa(n),
	})
}

func startRegionExporter(t testing.TB, dev *cudaipc.Device, size int64, seed uint64, env ...string) (*testutil.Child, regionMsg) {
	t.Helper()
	c := testutil.Spawn(t, "regionExporter", exporterEnv(dev, size, seed, env)...)
	return c, recvReply[regionMsg](t, c, "exporter")
}

func readMapping(t testing.TB, m *cudaipc.Mapping) []byte {
	t.Helper()
	b := make([]byte, m.Size())
	if _, err := m.ReadAt(b, 0); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRegionSubBuffersReadTheirBytes: sub-buffers exported at non-zero
// offsets read the exporter's bytes at those offsets, all through one open.
func TestRegionSubBuffersReadTheirBytes(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 8<<20 + 4096 + 17
	_, msg := startRegionExporter(t, dev, size, seed)
	want := testutil.RandomBytes(seed, size)
	before := cudaipc.ImportCacheStats()
	var ms []*cudaipc.Mapping
	defer func() {
		for _, m := range ms {
			m.Close()
		}
	}()
	for i, r := range msg.Subs {
		want0 := subRanges(size)[i]
		if r.Offset != want0[0] || r.Size != want0[1] || r.AllocSize < size || r.Handle != msg.Region.Handle || r.BufferID != msg.Region.BufferID {
			t.Fatalf("sub %d: %v", i, r)
		}
		m, err := cudaipc.Import(r)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
		if m.Local() || m.Device() != dev {
			t.Fatalf("sub %d: local %v device %v", i, m.Local(), m.Device())
		}
		if !bytes.Equal(readMapping(t, m), want[r.Offset:r.Offset+r.Size]) {
			t.Fatalf("sub %d at offset %d: wrong bytes", i, r.Offset)
		}
	}
	if d := cudaipc.ImportCacheStats().Opens - before.Opens; d != 1 {
		t.Fatalf("%d driver opens for %d sub-buffers of one allocation", d, len(msg.Subs))
	}
}

// TestImportThousandRegionsOneOpen: 1,000 imports of regions of one
// allocation cause one driver open and, after the last Close, one close.
func TestImportThousandRegionsOneOpen(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 1024 * 4096 // room for subRanges too
	_, msg := startRegionExporter(t, dev, size, seed)
	want := testutil.RandomBytes(seed, size)
	before := cudaipc.ImportCacheStats()
	liveBefore := cudaipc.LiveObjects()
	ms := make([]*cudaipc.Mapping, 0, 1000)
	t0 := time.Now()
	for i := int64(0); i < 1000; i++ {
		r, err := msg.Region.Sub(i*4096, 4096)
		if err != nil {
			t.Fatal(err)
		}
		m, err := cudaipc.Import(r)
		if err != nil {
			t.Fatal(err)
		}
		ms = append(ms, m)
	}
	elapsed := time.Since(t0)
	after := cudaipc.ImportCacheStats()
	if d := after.Opens - before.Opens; d != 1 {
		t.Fatalf("%d driver opens for 1000 imports", d)
	}
	if d := after.Hits - before.Hits; d != 999 {
		t.Fatalf("%d cache hits, want 999", d)
	}
	if l := cudaipc.LiveObjects(); l.Mappings-liveBefore.Mappings != 1000 || l.MemHandleOpens-liveBefore.MemHandleOpens != 1 {
		t.Fatalf("live %+v, before %+v", l, liveBefore)
	}
	for _, i := range []int{0, 1, 500, 999} {
		if !bytes.Equal(readMapping(t, ms[i]), want[i*4096:(i+1)*4096]) {
			t.Fatalf("region %d: wrong bytes", i)
		}
		if ms[i].Ptr() != ms[0].Ptr()+cudaipc.DevicePtr(i*4096) {
			t.Fatalf("region %d at %#x, first at %#x", i, ms[i].Ptr(), ms[0].Ptr())
		}
	}
	for _, m := range ms {
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
	}
	if d := cudaipc.ImportCacheStats().Closes - before.Closes; d != 1 {
		t.Fatalf("%d driver closes after the last Close", d)
	}
	if cudaipc.LiveObjects() != liveBefore {
		t.Fatalf("live objects %+v, before %+v", cudaipc.LiveObjects(), liveBefore)
	}
	t.Logf("1000 imports in %v (%v each, one open)", elapsed, elapsed/1000)
}

// TestImportConcurrentOpensOnce: 32 goroutines importing one allocation at
// once cause one driver open.
func TestImportConcurrentOpensOnce(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 64 << 20
	_, msg := startRegionExporter(t, dev, size, seed)
	before := cudaipc.ImportCacheStats()
	ms := make([]*cudaipc.Mapping, 32)
	errs := make([]error, 32)
	start := make(chan struct{})
	var wg sync.WaitGroup
	for i := range ms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			r, _ := msg.Region.Sub(int64(i)<<20, 1<<20)
			ms[i], errs[i] = cudaipc.Import(r)
		}()
	}
	close(start)
	wg.Wait()
	defer func() {
		for _, m := range ms {
			if m != nil {
				m.Close()
			}
		}
	}()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("goroutine %d: %v", i, err)
		}
	}
	if d := cudaipc.ImportCacheStats().Opens - before.Opens; d != 1 {
		t.Fatalf("%d driver opens for 32 concurrent imports", d)
	}
	want := testutil.RandomBytes(seed, size)
	if !bytes.Equal(readMapping(t, ms[31]), want[31<<20:32<<20]) {
		t.Fatal("wrong bytes")
	}
}

// TestImportAfterReallocNotStale: the exporter frees the allocation and
// exports a new one (often at the same address, with the same handle bytes)
// while this process still maps the old one. The new region must never be
// served from the old mapping.
func TestImportAfterReallocNotStale(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed1, seed2 := uint64(time.Now().UnixNano()), uint64(time.Now().UnixNano())^0x5555
	const size = 4 << 20
	c, msg1 := startRegionExporter(t, dev, size, seed1)
	old, err := cudaipc.Import(msg1.Region)
	if err != nil {
		t.Fatal(err)
	}
	defer old.Close()
	sum1, sum2 := testutil.Sum(testutil.RandomBytes(seed1, size)), testutil.Sum(testutil.RandomBytes(seed2, size))
	if testutil.Sum(readMapping(t, old)) != sum1 {
		t.Fatal("first allocation: wrong bytes")
	}
	msg2 := askHelper[regionMsg](t, c, "realloc", cmd{Op: "realloc", Seed: seed2})
	sameHandle := msg2.Region.Handle == msg1.Region.Handle
	t.Logf("realloc: same address %v, same handle bytes %v, buffer id %d -> %d",
		msg2.Region.ExporterBase == msg1.Region.ExporterBase, sameHandle, msg1.Region.BufferID, msg2.Region.BufferID)
	if msg2.Region.BufferID == msg1.Region.BufferID {
		t.Fatal("the driver reused the buffer id: stale detection cannot work")
	}
	before := cudaipc.ImportCacheStats()
	m, err := cudaipc.Import(msg2.Region)
	switch {
	case errors.Is(err, cudaipc.ErrStaleMapping):
		if !sameHandle {
			t.Fatalf("ErrStaleMapping for a different handle: %v", err)
		}
		t.Logf("refused while the old mapping is open: %v", err)
	case err != nil:
		t.Fatal(err)
	default:
		got := testutil.Sum(readMapping(t, m))
		m.Close()
		if got == sum1 {
			t.Fatal("served the freed allocation's bytes from the stale entry")
		}
		if got != sum2 {
			t.Fatal("new allocation: wrong bytes")
		}
	}
	if sameHandle && cudaipc.ImportCacheStats().Stale == before.Stale {
		t.Fatal("the stale entry was not dropped")
	}
	// Once the old mapping is closed, the new allocation imports cleanly.
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	m, err = cudaipc.Import(msg2.Region)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if testutil.Sum(readMapping(t, m)) != sum2 {
		t.Fatal("after closing the old mapping: wrong bytes")
	}
}

// TestImportInExportingProcess: a region imported by its own exporter is
// the local memory, without a driver open, and Buffer.Free refuses while it
// is mapped.
func TestImportInExportingProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 2<<20 + 3
	buf, err := dev.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), size)
	if _, err := buf.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	r, err := buf.Export(1<<20+5, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if r.ExporterPID != os.Getpid() || r.Offset != 1<<20+5 || r.ExporterBase != buf.Ptr() || r.Device != dev.UUID() {
		t.Fatalf("region %v", r)
	}
	r2, err := cudaipc.Export(dev, buf.Ptr()+(1<<20+5), 4096)
	if err != nil || !r2.Equal(r) {
		t.Fatalf("Export of the interior pointer: %v\n%v\n%v", err, r2, r)
	}
	if _, err := buf.Export(size-10, 11); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("range past the end: %v", err)
	}
	if _, err := cudaipc.Export(dev, buf.Ptr()+size-10, 1<<20); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("Export past the allocation: %v", err)
	}
	before := cudaipc.ImportCacheStats()
	m, err := cudaipc.Import(r)
	if err != nil {
		t.Fatal(err)
	}
	if !m.Local() || m.Ptr() != buf.Ptr()+(1<<20+5) || m.Device() != dev {
		t.Fatalf("local import at %#x on %v", m.Ptr(), m.Device())
	}
	if !bytes.Equal(readMapping(t, m), data[1<<20+5:1<<20+5+4096]) {
		t.Fatal("wrong bytes")
	}
	if cudaipc.ImportCacheStats().Opens != before.Opens {
		t.Fatal("same-process import opened the handle")
	}
	if err := buf.Free(); !errors.Is(err, cudaipc.ErrInUse) {
		t.Fatalf("Free while mapped: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := buf.Free(); err != nil {
		t.Fatalf("Free after Close: %v", err)
	}
	if _, err := cudaipc.Import(r); err == nil {
		t.Fatal("import of a freed buffer's region succeeded")
	}
}

// TestImportPicksDeviceByUUID: on two GPUs, with CUDA_VISIBLE_DEVICES
// renumbering them, the importer maps through the device whose UUID is the
// exporter's, never by ordinal.
func TestImportPicksDeviceByUUID(t *testing.T) {
	devs := testutil.RequireGPUs(t, 2)
	seed := uint64(time.Now().UnixNano())
	const size = 16 << 20
	sum := testutil.Sum(testutil.RandomBytes(seed, size))

	// The exporter sees only GPU 1, as its ordinal 0; this process must map
	// through its ordinal 1.
	_, msg := startRegionExporter(t, devs[1], size, seed, "CUDA_VISIBLE_DEVICES="+devs[1].UUID().String())
	if msg.Region.Device != devs[1].UUID() {
		t.Fatalf("exporter used %s", msg.Region.Device)
	}
	m, err := cudaipc.Import(msg.Region)
	if err != nil {
		t.Fatal(err)
	}
	if m.Device() != devs[1] {
		t.Fatalf("mapped through %v, want %v", m.Device(), devs[1])
	}
	if testutil.Sum(readMapping(t, m)) != sum {
		t.Fatal("wrong bytes")
	}
	m.Close()

	// An importer that sees GPU 1 then GPU 0: its ordinal 0 is GPU 1.
	text, _ := json.Marshal(msg.Region)
	imp := testutil.Spawn(t, "regionImporter", "REGION="+string(text),
		"CUDA_VISIBLE_DEVICES="+devs[1].UUID().String()+","+devs[0].UUID().String())
	var r map[string]string
	if err := imp.Recv(&r); err != nil || r["err"] != "" {
		t.Fatalf("importer: %v %s\n%s", err, r["err"], imp.Stderr())
	}
	if r["uuid"] != devs[1].UUID().String() || r["ordinal"] != "0" || r["visible"] != "2" || r["sum"] != sum {
		t.Fatalf("remapped importer: %v", r)
	}

	// An importer that does not see GPU 1 maps through its device 0 (GPU 0)
	// with peer access.
	imp = testutil.Spawn(t, "regionImporter", "REGION="+string(text), "CUDA_VISIBLE_DEVICES="+devs[0].UUID().String())
	if err := imp.Recv(&r); err != nil || r["err"] != "" {
		t.Fatalf("importer: %v %s\n%s", err, r["err"], imp.Stderr())
	}
	if r["uuid"] != devs[0].UUID().String() || r["visible"] != "1" || r["sum"] != sum {
		t.Fatalf("importer with GPU 1 hidden: %v", r)
	}
}

// TestEventSignalWait: the consumer's stream waits on the producer's Signal
// through an imported EventDescriptor; imports of one event share one open.
func TestEventSignalWait(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seedA, seedB := uint64(time.Now().UnixNano()), uint64(time.Now().UnixNano())^0xabcdef
	const size = 4 << 20
	c, msg := startRegionExporter(t, dev, size, seedA)
	m, err := cudaipc.Import(msg.Region)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	before := cudaipc.ImportCacheStats()
	ev, err := cudaipc.ImportEvent(msg.Event)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	ev2, err := cudaipc.ImportEvent(msg.Event)
	if err != nil {
		t.Fatal(err)
	}
	if d := cudaipc.ImportCacheStats().EventOpens - before.EventOpens; d != 1 {
		t.Fatalf("%d event opens for two imports", d)
	}
	if err := ev2.Close(); err != nil {
		t.Fatal(err)
	}
	readAfterLateWrite(t, dev, c, m.Ptr(), size, testutil.Sum(testutil.RandomBytes(seedA, size)), seedB, ev.Wait)
}

// TestEventImportInExportingProcess: the exporter's own event comes back
// without cuIpcOpenEventHandle.
func TestEventImportInExportingProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	ev, err := dev.NewIPCEvent()
	if err != nil {
		t.Fatal(err)
	}
	d, err := ev.Export()
	if err != nil {
		t.Fatal(err)
	}
	before := cudaipc.ImportCacheStats()
	re, err := cudaipc.ImportEvent(d)
	if err != nil {
		t.Fatal(err)
	}
	if err := ev.Signal(nil); err != nil {
		t.Fatal(err)
	}
	if err := re.Synchronize(); err != nil {
		t.Fatal(err)
	}
	if cudaipc.ImportCacheStats().EventOpens != before.EventOpens {
		t.Fatal("opened the own event through the driver")
	}
	if err := re.Close(); err != nil {
		t.Fatal(err)
	}
	if err := ev.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := cudaipc.ImportEvent(d); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("import of a closed own event: %v", err)
	}
	plain, err := dev.NewEvent(cudaipc.EventDisableTiming)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if err := plain.Signal(nil); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("Signal of a non-IPC event: %v", err)
	}
}
