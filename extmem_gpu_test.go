package cudaipc_test

import (
	"bytes"
	"errors"
	"os"
	"reflect"
	"strconv"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// piecesMsg is what the pieces exporter tells the test.
type piecesMsg struct {
	Region *cudaipc.Region `json:",omitempty"`
	Sum    string          // of the exported range, now
	Err    string
}

// rolePiecesExporter runs in a sibling container. It makes a range of
// PIECES granules backed by one allocation each (as PyTorch's expandable
// segments do), fills it with random bytes from SEED, exports
// [granule/2, granule/2 + SIZE) with ExportPointer, sends the descriptors
// on descriptor 3 and the region on stdout. Then, on "sum", it reports the
// range's hash; on "exit" it exits without freeing anything.
func rolePiecesExporter(p *testutil.Peer) error {
	sock := os.NewFile(3, "sock")
	dev, err := helperDevice()
	if err != nil {
		return err
	}
	n, _ := strconv.Atoi(os.Getenv("PIECES"))
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	e, err := cudaipc.NewExpandableForTest(dev, n, true)
	if err != nil {
		return err
	}
	if err := dev.CopyToDevice(e.Ptr(), testutil.RandomBytes(seed, int(e.Size()))); err != nil {
		return err
	}
	start := e.Ptr() + cudaipc.DevicePtr(e.Piece()/2)
	r, files, err := cudaipc.ExportPointer(dev, start, size)
	if err != nil {
		return p.Send(piecesMsg{Err: err.Error()})
	}
	if r.Kind != cudaipc.KindVMMFD {
		return p.Send(piecesMsg{Err: "exported as a legacy region"})
	}
	for _, f := range files {
		if err := sendFD(sock, f); err != nil {
			return err
		}
		f.Close()
	}
	sum := func() string {
		b := make([]byte, size)
		if err := dev.CopyFromDevice(b, start); err != nil {
			return "err " + err.Error()
		}
		return testutil.Sum(b)
	}
	if err := p.Send(piecesMsg{Region: &r, Sum: sum()}); err != nil {
		return err
	}
	for {
		var c fdCmd
		if err := p.Recv(&c); err != nil {
			return nil
		}
		switch c.Op {
		case "sum":
			p.Send(piecesMsg{Sum: sum()})
		case "exit":
			os.Exit(0)
		}
	}
}

// An expandable-segment-like range (three allocations back to back) is
// exported with ExportPointer in a sibling container as a version 2 region
// and imported here read-only through the cache: the bytes match; a second
// import of the region and one of a part of it share the driver mapping; a
// memset and a copy through the read-only mapping fail and the exporter's
// bytes stay unchanged; after the exporter exits without freeing, the
// mapping still reads the same bytes.
func TestExportPointerPiecesAcrossContainers(t *testing.T) {
	dev := testutil.RequireGPU(t)
	testutil.RequireContainers(t)
	g, err := dev.VMMGranularity()
	if err != nil {
		t.Fatal(err)
	}
	seed := uint64(time.Now().UnixNano())
	size := 2*g + 4096 // from half into piece 0 to past the start of piece 2
	mine, theirs := fdSockets(t)
	ctr := testutil.Container{Share: t.TempDir(), UID: 10001, GID: 10001}
	o, err := ctr.SpawnOptions("PIECES=3", "SEED="+strconv.FormatUint(seed, 10), "SIZE="+strconv.FormatInt(size, 10), "DEVICE="+dev.UUID().String())
	if err != nil {
		t.Fatal(err)
	}
	o.ExtraFiles = []*os.File{theirs}
	c := testutil.SpawnWith(t, "piecesExporter", o)
	theirs.Close()
	var m piecesMsg
	if err := c.Recv(&m); err != nil || m.Err != "" {
		t.Fatalf("exporter: %v %s\n%s", err, m.Err, c.Stderr())
	}
	want := testutil.RandomBytes(seed, int(3*g))[g/2 : g/2+size]
	if m.Sum != testutil.Sum(want) {
		t.Fatal("the exporter's range does not hold the bytes it wrote")
	}
	r := m.Region
	if r == nil || r.Version != cudaipc.RegionVersionPieces || r.Offset != g/2 || r.Size != size || len(r.Pieces()) != 3 || r.AllocSize != g || r.MappedSize() != 3*g {
		t.Fatalf("region %v, want offset %d, size %d, 3 pieces of %d", r, g/2, size, g)
	}
	var files []*os.File
	for range r.Pieces() {
		f, err := recvFD(mine)
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, f)
	}
	before, stats := cudaipc.LiveObjects().FDMappings, cudaipc.ImportCacheStats()
	pm, err := cudaipc.Import(*r, cudaipc.WithFiles(files...), cudaipc.WithAccess(cudaipc.ReadOnly))
	if err != nil {
		t.Fatal(err)
	}
	defer pm.Close()
	// The same pieces again, and a part of them: the cache's mapping.
	again, err := cudaipc.Import(*r, cudaipc.WithFiles(files...), cudaipc.WithAccess(cudaipc.ReadOnly))
	if err != nil {
		t.Fatal(err)
	}
	part, _ := r.Sub(g, 4096)
	pp, err := cudaipc.Import(part, cudaipc.WithFiles(files...), cudaipc.WithAccess(cudaipc.ReadOnly))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		f.Close()
	}
	if n := cudaipc.LiveObjects().FDMappings - before; n != 1 {
		t.Fatalf("%d live driver mappings for three imports of one range", n)
	}
	if s := cudaipc.ImportCacheStats(); s.Opens-stats.Opens != 1 || s.Hits-stats.Hits != 2 || pp.Ptr() != pm.Ptr()+cudaipc.DevicePtr(g) {
		t.Fatalf("cache: %d opens, %d hits, part at %#x of %#x", s.Opens-stats.Opens, s.Hits-stats.Hits, pp.Ptr(), pm.Ptr())
	}
	pb := make([]byte, 4096)
	if _, err := pp.ReadAt(pb, 0); err != nil || !bytes.Equal(pb, want[g:g+4096]) {
		t.Fatalf("the part reads other bytes (%v)", err)
	}
	again.Close()
	pp.Close()
	read := func() []byte {
		b := make([]byte, size)
		if _, err := pm.ReadAt(b, 0); err != nil {
			t.Fatal(err)
		}
		return b
	}
	if !bytes.Equal(read(), want) {
		t.Fatal("the read-only mapping reads other bytes than the exporter wrote")
	}

	// Writes through the read-only mapping.
	merr := dev.Memset(pm.Ptr(), 0, size)
	_, werr := pm.WriteAt(testutil.RandomBytes(seed+1, 4096), 0)
	t.Logf("read-only mapping: memset -> %v; host-to-device copy -> %v", merr, werr)
	if merr == nil {
		t.Error("a memset through the read-only mapping succeeded")
	}
	if werr == nil {
		t.Error("a copy into the read-only mapping succeeded")
	}
	if err := c.Send(fdCmd{Op: "sum"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Recv(&m); err != nil || m.Sum != testutil.Sum(want) {
		t.Fatalf("the exporter's bytes changed after the reader's writes (%v)", err)
	}
	if !bytes.Equal(read(), want) {
		t.Fatal("the reader's bytes changed after its failed writes")
	}

	// The exporter exits without freeing: the descriptors' references keep
	// the memory.
	c.Send(fdCmd{Op: "exit"})
	if err := c.Wait(30 * time.Second); err != nil {
		t.Fatalf("exporter: %v", err)
	}
	if !bytes.Equal(read(), want) {
		t.Fatal("the mapping changed after the exporter exited")
	}
	if err := pm.Close(); err != nil {
		t.Fatal(err)
	}
	if err := pm.Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if _, err := pm.ReadAt(make([]byte, 1), 0); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("ReadAt after Close: %v", err)
	}
}

// ExportPointer on this process's memory of each kind: cuMemAlloc gives a
// legacy region; VMM memory without the descriptor handle type, host
// memory and garbage give typed errors naming the fix; a read-write import
// of its own VMM export writes through.
func TestExportPointerKinds(t *testing.T) {
	dev := testutil.RequireGPU(t)
	b, err := dev.Alloc(3 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	lr, none, err := cudaipc.ExportPointer(dev, b.Ptr()+(1<<20), 4096)
	if err != nil {
		t.Fatal(err)
	}
	if len(none) != 0 || lr.Kind != cudaipc.KindCUDAIPC || lr.Offset != 1<<20 || lr.Size != 4096 {
		t.Fatalf("cuMemAlloc memory: %v, %d files", lr, len(none))
	}

	nofd, err := cudaipc.NewExpandableForTest(dev, 1, false)
	if err != nil {
		t.Fatal(err)
	}
	defer nofd.Free()
	_, _, err = cudaipc.ExportPointer(dev, nofd.Ptr(), 4096)
	var ne *cudaipc.NotExportableError
	if !errors.As(err, &ne) || !errors.Is(err, cudaipc.ErrNotExportable) || ne.Fix != cudaipc.FixVMMNoFD {
		t.Fatalf("VMM memory without POSIX fd handles: %v", err)
	}
	t.Logf("VMM without fd handles: %v", err)

	h, err := dev.AllocHost(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Free()
	_, _, err = cudaipc.ExportPointer(dev, cudaipc.DevicePtr(reflect.ValueOf(&h.Bytes()[0]).Pointer()), 4096)
	if !errors.Is(err, cudaipc.ErrNotExportable) {
		t.Fatalf("pinned host memory: %v", err)
	}
	t.Logf("host memory: %v", err)

	e, err := cudaipc.NewExpandableForTest(dev, 2, true)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Free()
	if _, _, err := cudaipc.ExportPointer(dev, e.Ptr(), e.Size()+1); err == nil {
		t.Fatal("export past the end of the mapped range succeeded")
	}
	vr, files, err := cudaipc.ExportPointer(dev, e.Ptr(), e.Size())
	if err != nil {
		t.Fatal(err)
	}
	if vr.Kind != cudaipc.KindVMMFD || len(files) != 2 || len(vr.Pieces()) != 2 || vr.Size != e.Size() {
		t.Fatalf("VMM memory of two allocations: %v, %d files", vr, len(files))
	}
	rw, err := cudaipc.Import(vr, cudaipc.WithFiles(files...))
	for _, f := range files {
		f.Close()
	}
	if err != nil {
		t.Fatal(err)
	}
	defer rw.Close()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), int(e.Size()))
	if _, err := rw.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, e.Size())
	if err := dev.CopyFromDevice(got, e.Ptr()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) {
		t.Fatal("a write through a read-write import does not show in the original range")
	}
	ok, err := cudaipc.ReadOnlyMappingSupported(dev)
	if err != nil || !ok {
		t.Fatalf("ReadOnlyMappingSupported: %v %v", ok, err)
	}
}
