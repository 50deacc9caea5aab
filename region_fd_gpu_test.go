package cudaipc_test

import (
	"errors"
	"fmt"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// Regions of VMM allocations (KindVMMFD) imported with Import and WithFile:
// the same *Mapping as for legacy regions, through the process-wide cache.

// fdRegionCmd is what a test tells an fdRegionImporter to do next.
type fdRegionCmd struct {
	Op      string           // "import" (a descriptor follows on the socket), "write", "close"
	Regions []cudaipc.Region // "import": regions of the descriptor's allocation
	Index   int              // "write": which mapping
	Seed    uint64
}

// fdRegionReply is what an fdRegionImporter answers.
type fdRegionReply struct {
	Sums  []string // of each mapping's bytes
	Stats cudaipc.CacheStats
	Live  cudaipc.Live
	Pid   int
	PidNS string
	Err   string
}

// roleFDRegionImporter imports regions with the descriptor received on
// descriptor 3: a consumer of a store daemon, or of another container.
func roleFDRegionImporter(p *testutil.Peer) error {
	sock := os.NewFile(3, "sock")
	var ms []*cudaipc.Mapping
	sums := func() ([]string, error) {
		var out []string
		for _, m := range ms {
			b := make([]byte, m.Size())
			if _, err := m.ReadAt(b, 0); err != nil {
				return nil, err
			}
			out = append(out, testutil.Sum(b))
		}
		return out, nil
	}
	for {
		var c fdRegionCmd
		if err := p.Recv(&c); err != nil {
			return nil
		}
		var r fdRegionReply
		var err error
		switch c.Op {
		case "import":
			var f *os.File
			if f, err = recvFD(sock); err != nil {
				return err
			}
			for _, reg := range c.Regions {
				var m *cudaipc.Mapping
				if m, err = cudaipc.Import(reg, cudaipc.WithFile(f)); err != nil {
					break
				}
				ms = append(ms, m)
			}
			f.Close() // the mappings hold their own reference
		case "write":
			m := ms[c.Index]
			_, err = m.WriteAt(testutil.RandomBytes(c.Seed, int(m.Size())), 0)
		case "close":
			for _, m := range ms {
				if err = errors.Join(err, m.Close(), m.Close()); err != nil {
					break
				}
			}
			ms = nil
		default:
			return fmt.Errorf("unknown command %q", c.Op)
		}
		if err == nil {
			r.Sums, err = sums()
		}
		if err != nil {
			r.Err = err.Error()
		}
		r.Stats, r.Live, r.Pid, r.PidNS = cudaipc.ImportCacheStats(), cudaipc.LiveObjects(), os.Getpid(), pidNS()
		if err := p.Send(r); err != nil {
			return err
		}
	}
}

func askRegion(t *testing.T, c *testutil.Child, cmd fdRegionCmd) fdRegionReply {
	t.Helper()
	return askHelper[fdRegionReply](t, c, cmd.Op, cmd)
}

// shareRegions exports pieces of b as regions, sends them with one
// descriptor to an fdRegionImporter and checks that it reads each piece's
// bytes through one import of the allocation.
func shareRegions(t *testing.T, b *cudaipc.ShareableBuffer, attr *syscall.SysProcAttr, env ...string) (*testutil.Child, []cudaipc.Region, fdRegionReply) {
	t.Helper()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size()))
	if _, err := b.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	var regions []cudaipc.Region
	for _, p := range [][2]int64{{0, b.Size()}, {1<<20 + 17, 4096}, {b.Size() - 100, 100}, {4096, 1}} {
		r, err := b.Export(p[0], p[1])
		if err != nil {
			t.Fatal(err)
		}
		if r.Kind != cudaipc.KindVMMFD || r.AllocationID != b.AllocationID() || r.AllocSize != b.Size() {
			t.Fatalf("Export(%d, %d) = %v", p[0], p[1], r)
		}
		regions = append(regions, r)
	}
	c, mine := spawnWithSocket(t, "fdRegionImporter", attr, env)
	f, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Send(fdRegionCmd{Op: "import", Regions: regions}); err != nil {
		t.Fatal(err)
	}
	if err := sendFD(mine, f); err != nil {
		t.Fatal(err)
	}
	f.Close()
	r := recvReply[fdRegionReply](t, c, "import")
	for i, reg := range regions {
		if want := testutil.Sum(data[reg.Offset : reg.Offset+reg.Size]); r.Sums[i] != want {
			t.Fatalf("region %d (%d bytes at %d): the importer read other bytes", i, reg.Size, reg.Offset)
		}
	}
	if r.Stats.Opens != 1 || r.Stats.Hits != int64(len(regions)-1) || r.Stats.Mapped != 1 {
		t.Fatalf("importer cache: %+v; want one open for %d regions of one allocation", r.Stats, len(regions))
	}
	return c, regions, r
}

// TestImportVMMFDRegionAcrossProcesses: another process imports four
// regions of one shareable allocation with one descriptor, reads each
// region's bytes, writes through one, and the exporter sees the write;
// after the exporter frees, the importer's mappings still hold the memory.
func TestImportVMMFDRegionAcrossProcesses(t *testing.T) {
	dev := testutil.RequireGPU(t)
	b, err := dev.AllocShareable(8<<20 + 5)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	c, _, r := shareRegions(t, b, nil)
	if r.Pid == os.Getpid() {
		t.Fatal("the importer ran in the test process")
	}
	seed := uint64(time.Now().UnixNano())
	askRegion(t, c, fdRegionCmd{Op: "write", Index: 0, Seed: seed})
	want := testutil.RandomBytes(seed, int(b.Size()))
	if string(readShareable(t, b)) != string(want) {
		t.Fatal("the exporter does not see the importer's writes through the region")
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if r := askRegion(t, c, fdRegionCmd{Op: "write", Index: 1, Seed: seed + 1}); r.Sums[0] == testutil.Sum(want) {
		t.Fatal("a write through one region did not show through the other")
	}
	r = askRegion(t, c, fdRegionCmd{Op: "close"})
	if r.Live != (cudaipc.Live{}) || r.Stats.Mapped != 0 || r.Stats.Closes != 1 {
		t.Fatalf("importer after Close: live %+v, cache %+v", r.Live, r.Stats)
	}
}

// TestImportVMMFDRegionIntoNewPIDNamespace is the container case through
// Import: the importer runs in a new PID namespace, where the cuda-ipc
// region of the same memory would be refused, and maps the vmm-fd region.
func TestImportVMMFDRegionIntoNewPIDNamespace(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if os.Geteuid() != 0 {
		t.Skip("creating a PID namespace needs root (CAP_SYS_ADMIN); the GPU machine runs tests as root")
	}
	b, err := dev.AllocShareable(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	attr, env := testutil.NewNamespaces()
	c, _, r := shareRegions(t, b, attr, env)
	requireNewPIDNamespace(t, r.Pid, r.PidNS)
	checkWritesFromNamespace(t, b,
		func(seed uint64) { askRegion(t, c, fdRegionCmd{Op: "write", Index: 0, Seed: seed}) },
		func() cudaipc.Live { return askRegion(t, c, fdRegionCmd{Op: "close"}).Live })
}

// TestImportVMMFDRegionInExportingProcess: the exporter imports its own
// region through a descriptor (the driver allows it), sees its bytes, and
// a region claiming more than the allocation is refused by name, before
// any copy.
func TestImportVMMFDRegionInExportingProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	b, err := dev.AllocShareable(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size()))
	if _, err := b.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	f, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	before := cudaipc.ImportCacheStats()
	r, err := b.Export(4096, 8192)
	if err != nil {
		t.Fatal(err)
	}
	m, err := cudaipc.Import(r, cudaipc.WithFile(f))
	if err != nil {
		t.Fatal(err)
	}
	if m.Local() || m.Ptr() == b.Ptr()+4096 || string(readMapping(t, m)) != string(data[4096:4096+8192]) {
		t.Fatalf("own vmm-fd region: local %v at %#x", m.Local(), m.Ptr())
	}
	if _, err := cudaipc.Import(r); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("Import of a vmm-fd region without WithFile: %v", err)
	}

	// A region that claims twice the allocation, and a size past the real
	// end: refused when the allocation is already mapped...
	big := r
	big.AllocSize, big.Offset, big.Size = 2*b.Size(), b.Size(), 4096
	var re *cudaipc.RegionError
	if _, err := cudaipc.Import(big, cudaipc.WithFile(f)); !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("region larger than its (mapped) allocation: %v", err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	// ... and by the driver's refusal to map past the end when it is not.
	_, err = cudaipc.Import(big, cudaipc.WithFile(f))
	if !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("region larger than its allocation: %v", err)
	}
	t.Logf("refused: %v", err)
	after := cudaipc.ImportCacheStats()
	if after.Opens-before.Opens != 1 || after.Mapped != before.Mapped {
		t.Fatalf("cache before %+v after %+v", before, after)
	}
}

// TestImportRefusesAllocSizeLargerThanAllocation: a cuda-ipc region of
// another process that claims a larger allocation than the driver maps is
// refused naming alloc_size, where a copy would otherwise fail with a bare
// CUDA_ERROR_INVALID_VALUE.
func TestImportRefusesAllocSizeLargerThanAllocation(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 4<<20 + 3
	c, msg := startRegionExporter(t, dev, size, uint64(time.Now().UnixNano()))
	defer c.Send(cmd{Op: "exit"})
	ok, err := cudaipc.Import(msg.Region)
	if err != nil {
		t.Fatal(err)
	}
	defer ok.Close()
	big := msg.Region
	big.AllocSize, big.Offset, big.Size = 2*size, size, 4096
	_, err = cudaipc.Import(big)
	var re *cudaipc.RegionError
	if !errors.As(err, &re) || re.Field != "alloc_size" {
		t.Fatalf("region larger than its allocation: %v", err)
	}
	t.Logf("refused: %v", err)
	// The honest region still reads.
	if len(readMapping(t, ok)) != size {
		t.Fatal("short read")
	}
}
