package store

import (
	"bytes"
	"crypto/rand"
	"fmt"
	"os"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

const testGPU = "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"

// memfdPiece stands in for a VMM descriptor: the daemon never maps what it
// is given, so any descriptor travels the same way, and a memfd's bytes
// show that the reader got the very file the exporter registered.
func memfdPiece(t *testing.T, content []byte) *os.File {
	t.Helper()
	fd, err := unix.MemfdCreate("piece", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "piece")
	if _, err := f.Write(content); err != nil {
		t.Fatal(err)
	}
	return f
}

func readAll(t *testing.T, f *os.File) []byte {
	t.Helper()
	b := make([]byte, 64)
	n, err := f.ReadAt(b, 0)
	if err != nil && n == 0 {
		t.Fatal(err)
	}
	return b[:n]
}

func (rc *rawClient) register(r *storev1.RegisterRequest, files ...*os.File) *storev1.Response {
	rc.t.Helper()
	rc.id++
	if err := rc.c.Send(&storev1.Request{Id: rc.id, Body: &storev1.Request_Register{Register: r}}, files...); err != nil {
		rc.t.Fatal(err)
	}
	resp, got := rc.recv(rc.id)
	protocol.CloseFiles(got)
	return resp
}

// vmmRegion is the binary vmm-fd region of size bytes at offset off of a
// range of the given allocations' sizes (version 2 for more than one).
func vmmRegion(t *testing.T, off, size int64, pieces ...int64) []byte {
	t.Helper()
	u, _ := cudaipc.ParseUUID(testGPU)
	r := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindVMMFD, AllocationID: cudaipc.NewAllocationID(),
		Offset: off, Size: size, AllocSize: pieces[0], Device: u, ExporterPID: 42, PIDNamespace: 4026531836,
		BootID: cudaipc.BootID{1}, ExporterBase: 0x7f0000000000}
	for _, n := range pieces[1:] {
		r.Version = cudaipc.RegionVersionPieces
		r.MorePieces = append(r.MorePieces, cudaipc.Piece{AllocationID: cudaipc.NewAllocationID(), Size: n})
	}
	b, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func (rc *rawClient) stat(name string) (*storev1.ObjectInfo, storev1.Error_Code) {
	rc.t.Helper()
	resp, _ := rc.do(req(&storev1.StatRequest{Name: name}))
	return resp.GetStat().GetInfo(), code(resp)
}

// A registration's descriptors reach readers as they were sent; when the
// exporter disconnects, the object is orphaned while leased and dropped
// (descriptors closed) when the last lease ends.
func TestRegisterVMMOrphanedUntilLastRelease(t *testing.T) {
	_, path, _ := serveGPU(t, Config{})
	exp := dialRaw(t, path)
	contents := [][]byte{make([]byte, 32), make([]byte, 32)}
	var files []*os.File
	for _, c := range contents {
		rand.Read(c)
		f := memfdPiece(t, c)
		defer f.Close()
		files = append(files, f)
	}
	region := vmmRegion(t, 1<<20, 3<<20, 2<<20, 2<<20)
	r := &storev1.RegisterRequest{Name: "torch/w", Size: 3 << 20, Device: testGPU, Shared: true, Region: region, Files: 2}
	resp := exp.register(r, files...)
	wantCode(t, resp, storev1.Error_OK)
	if in := resp.GetRegister().GetInfo(); !in.GetExternal() || in.GetOrphaned() || in.GetExporterBound() || !in.GetSealed() {
		t.Fatalf("register info %v", in)
	}
	wantCode(t, exp.register(r, files...), storev1.Error_EXISTS)
	cr, _ := exp.do(req(&storev1.CreateRequest{Name: "torch/w", Size: 1}))
	wantCode(t, cr, storev1.Error_EXISTS)

	rd := dialRaw(t, path)
	g, got := rd.do(req(&storev1.GetRequest{Name: "torch/w"}))
	wantCode(t, g, storev1.Error_OK)
	p := g.GetGet().GetPlacement()
	if !p.GetExternal() || p.GetOffset() != 0 || p.GetSize() != 3<<20 || !bytes.Equal(p.GetRegion(), region) || p.GetFiles() != 2 || len(got) != 2 {
		t.Fatalf("placement %v with %d files", p, len(got))
	}
	for i, f := range got {
		if !bytes.Equal(readAll(t, f), contents[i]) {
			t.Fatalf("piece %d: the reader got another file than the exporter sent", i)
		}
	}
	protocol.CloseFiles(got)

	exp.c.Close()
	testutil.Eventually(t, testutil.Wait, func() error { // the daemon notices the close asynchronously
		in, c := rd.stat("torch/w")
		if c != storev1.Error_OK {
			t.Fatalf("stat after the exporter left: %v", c)
		}
		if !in.GetOrphaned() {
			return fmt.Errorf("torch/w not orphaned after its exporter left: %v", in)
		}
		if in.GetLeases() != 1 {
			t.Fatalf("orphaned with %d leases", in.GetLeases())
		}
		return nil
	})
	rel, _ := rd.do(req(&storev1.ReleaseRequest{LeaseId: g.GetGet().GetLeaseId()}))
	wantCode(t, rel, storev1.Error_OK)
	if _, c := rd.stat("torch/w"); c != storev1.Error_NOT_FOUND {
		t.Fatalf("stat after the last release of an orphan: %v, want NOT_FOUND", c)
	}
}

// A legacy registration is removed when its exporter disconnects, leases
// or not; bad registrations are refused with INVALID.
func TestRegisterLegacyBoundToExporter(t *testing.T) {
	_, path, _ := serveGPU(t, Config{})
	exp := dialRaw(t, path)
	u, _ := cudaipc.ParseUUID(testGPU)
	var h cudaipc.MemHandle
	rand.Read(h[:])
	reg := cudaipc.Region{Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Handle: h, Offset: 4096, Size: 8192, AllocSize: 1 << 20,
		Device: u, ExporterPID: 42, PIDNamespace: 4026531836, BootID: cudaipc.BootID{1}, BufferID: 7, ExporterBase: 0x7f0000000000}
	b, err := reg.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	wantCode(t, exp.register(&storev1.RegisterRequest{Name: "cupy/a", Size: 8192, Device: testGPU, Region: b}), storev1.Error_OK)
	in, _ := exp.stat("cupy/a")
	if !in.GetExternal() || !in.GetExporterBound() || !bytes.Equal(in.GetRegion(), b) {
		t.Fatalf("stat %v", in)
	}
	rd := dialRaw(t, path)
	g, got := rd.do(req(&storev1.GetRequest{Name: "cupy/a"}))
	wantCode(t, g, storev1.Error_OK)
	if p := g.GetGet().GetPlacement(); len(got) != 0 || !p.GetExternal() || !bytes.Equal(p.GetRegion(), b) || p.GetFiles() != 0 {
		t.Fatalf("legacy placement %v with %d files", p, len(got))
	}
	exp.c.Close()
	// Removed although leased: the memory dies with its exporter.
	testutil.Eventually(t, testutil.Wait, func() error { // the daemon notices the close asynchronously
		if _, c := rd.stat("cupy/a"); c != storev1.Error_NOT_FOUND {
			return fmt.Errorf("stat of cupy/a after its exporter left: %v, want NOT_FOUND", c)
		}
		return nil
	})
	rel, _ := rd.do(req(&storev1.ReleaseRequest{LeaseId: g.GetGet().GetLeaseId()}))
	wantCode(t, rel, storev1.Error_OK)
	bad := map[string]*storev1.RegisterRequest{
		"size mismatch":  {Name: "x", Size: 4096, Device: testGPU, Region: b},
		"garbage region": {Name: "x", Size: 8192, Device: testGPU, Region: []byte("nope")},
		"not a uuid":     {Name: "x", Size: 8192, Device: "0", Region: b},
		"nothing":        {Name: "x", Size: 8192, Device: testGPU},
	}
	for name, r := range bad {
		if resp := rd.register(r); code(resp) != storev1.Error_INVALID {
			t.Errorf("%s: %v (%s), want INVALID", name, code(resp), resp.GetError().GetMessage())
		}
	}
	// A vmm-fd region with as many descriptors as the request says, but
	// not as many as the region has pieces; a cuda-ipc one with some.
	f := memfdPiece(t, []byte("x"))
	defer f.Close()
	for name, r := range map[string]*storev1.RegisterRequest{
		"one file for two pieces": {Name: "x", Size: 3 << 20, Device: testGPU, Region: vmmRegion(t, 0, 3<<20, 2<<20, 2<<20), Files: 1},
		"cuda-ipc with a file":    {Name: "x", Size: 8192, Device: testGPU, Region: b, Files: 1},
	} {
		if resp := rd.register(r, f); code(resp) != storev1.Error_INVALID {
			t.Errorf("%s: %v (%s), want INVALID", name, code(resp), resp.GetError().GetMessage())
		}
	}
}
