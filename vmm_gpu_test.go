package cudaipc_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// fdCmd is what a test tells an fd helper to do next.
type fdCmd struct {
	Op   string // "import", "write", "read", "close" (importer); "exit" (exporter)
	Size int64
	Seed uint64
}

// fdReply is what an fd helper answers.
type fdReply struct {
	Sum   string
	Size  int64 // mapped or allocated size
	Pid   int   // os.Getpid() in the helper: 1 in a new PID namespace
	PidNS string
	Live  cudaipc.Live
	Err   string
}

// fdSockets returns a connected SOCK_SEQPACKET pair: the test's end and the
// end for a helper (its descriptor 3 when passed in ExtraFiles). The test
// closes its copy of the helper's end once the helper started.
func fdSockets(t testing.TB) (mine, theirs *os.File) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mine, theirs = os.NewFile(uintptr(fds[0]), "test-sock"), os.NewFile(uintptr(fds[1]), "helper-sock")
	t.Cleanup(func() { mine.Close(); theirs.Close() })
	return mine, theirs
}

// sendFD sends f over sock with SCM_RIGHTS, as the store's protocol does.
func sendFD(sock, f *os.File) error {
	return unix.Sendmsg(int(sock.Fd()), []byte{'F'}, unix.UnixRights(int(f.Fd())), nil, 0)
}

// recvFD receives one descriptor sent by sendFD.
func recvFD(sock *os.File) (*os.File, error) {
	buf := make([]byte, 1)
	oob := make([]byte, unix.CmsgSpace(4))
	_, oobn, flags, _, err := unix.Recvmsg(int(sock.Fd()), buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return nil, err
	}
	if flags&unix.MSG_CTRUNC != 0 {
		return nil, errors.New("control message truncated")
	}
	msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
	if err != nil || len(msgs) != 1 {
		return nil, fmt.Errorf("want one control message, got %d (%v)", len(msgs), err)
	}
	fds, err := unix.ParseUnixRights(&msgs[0])
	if err != nil || len(fds) != 1 {
		return nil, fmt.Errorf("want one descriptor, got %d (%v)", len(fds), err)
	}
	return os.NewFile(uintptr(fds[0]), "received-cuda-fd"), nil
}

func pidNS() string {
	s, _ := os.Readlink("/proc/self/ns/pid")
	return s
}

// requireNewPIDNamespace fails the test unless a helper's pid and PID
// namespace say it runs as the first process of a namespace of its own.
func requireNewPIDNamespace(t *testing.T, pid int, ns string) {
	t.Helper()
	if pid != 1 || ns == pidNS() || ns == "" {
		t.Fatalf("importer has pid %d in %q, the test %q: not in a new PID namespace", pid, ns, pidNS())
	}
	t.Logf("importer: pid %d in %s (test: %s)", pid, ns, pidNS())
}

// roleFDImporter receives descriptors on descriptor 3, imports them on its
// device 0 and obeys commands: it is the consumer in another container.
func roleFDImporter(p *testutil.Peer) error {
	sock := os.NewFile(3, "sock")
	dev, err := helperDevice()
	if err != nil {
		return p.Send(fdReply{Err: err.Error()})
	}
	var m *cudaipc.Mapping
	read := func() fdReply {
		b := make([]byte, m.Size())
		if _, err := m.ReadAt(b, 0); err != nil {
			return fdReply{Err: err.Error()}
		}
		return fdReply{Sum: testutil.Sum(b), Size: m.Size()}
	}
	for {
		var c fdCmd
		if err := p.Recv(&c); err != nil {
			return nil // the test closed stdin or died
		}
		var r fdReply
		switch c.Op {
		case "import":
			f, err := recvFD(sock)
			if err != nil {
				return err
			}
			m, err = dev.ImportFD(f, c.Size)
			f.Close() // the mapping holds its own reference
			if err != nil {
				r = fdReply{Err: err.Error()}
				break
			}
			r = read()
		case "write":
			if _, err := m.WriteAt(testutil.RandomBytes(c.Seed, int(m.Size())), 0); err != nil {
				r = fdReply{Err: err.Error()}
				break
			}
			r = read()
		case "read":
			r = read()
		case "close":
			if err := m.Close(); err != nil {
				r.Err = err.Error()
			} else if err := m.Close(); err != nil {
				r.Err = "second Close: " + err.Error()
			}
			r.Live = cudaipc.LiveObjects()
		default:
			return fmt.Errorf("unknown command %q", c.Op)
		}
		r.Pid, r.PidNS = os.Getpid(), pidNS()
		if err := p.Send(r); err != nil {
			return err
		}
	}
}

// roleFDExporter allocates SIZE shareable bytes filled from SEED, sends a
// descriptor on descriptor 3, reports, and exits on "exit" or end of input
// without freeing (the driver cleans up as on a crash).
func roleFDExporter(p *testutil.Peer) error {
	sock := os.NewFile(3, "sock")
	dev, err := helperDevice()
	if err != nil {
		return p.Send(fdReply{Err: err.Error()})
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	b, err := dev.AllocShareable(size)
	if err != nil {
		return p.Send(fdReply{Err: err.Error()})
	}
	data := testutil.RandomBytes(seed, int(b.Size()))
	if _, err := b.WriteAt(data, 0); err != nil {
		return err
	}
	f, err := b.ExportFD()
	if err != nil {
		return err
	}
	if err := sendFD(sock, f); err != nil {
		return err
	}
	f.Close()
	if err := p.Send(fdReply{Sum: testutil.Sum(data), Size: b.Size(), Pid: os.Getpid()}); err != nil {
		return err
	}
	var c fdCmd
	_ = p.Recv(&c)
	os.Exit(0)
	return nil
}

// fdImporter starts an importer helper with its socket, and returns it with
// the test's end of the socket.
func fdImporter(t *testing.T, dev *cudaipc.Device, attr *syscall.SysProcAttr, env ...string) (*testutil.Child, *os.File) {
	t.Helper()
	return spawnWithSocket(t, "fdimporter", attr, append([]string{"DEVICE=" + dev.UUID().String()}, env...))
}

// spawnWithSocket starts the helper role with one end of an fdSockets pair
// as its descriptor 3 and returns it with the test's end.
func spawnWithSocket(t testing.TB, role string, attr *syscall.SysProcAttr, env []string) (*testutil.Child, *os.File) {
	t.Helper()
	mine, theirs := fdSockets(t)
	c := testutil.SpawnWith(t, role, testutil.SpawnOptions{Env: env, ExtraFiles: []*os.File{theirs}, SysProcAttr: attr})
	theirs.Close()
	return c, mine
}

// startFDExporter starts an fdexporter of size bytes filled from seed and
// returns it with its report and the descriptor it sent.
func startFDExporter(t testing.TB, dev *cudaipc.Device, size int64, seed uint64) (*testutil.Child, fdReply, *os.File) {
	t.Helper()
	c, mine := spawnWithSocket(t, "fdexporter", nil, exporterEnv(dev, size, seed, nil))
	r := recvReply[fdReply](t, c, "exporter")
	f, err := recvFD(mine)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return c, r, f
}

func ask(t *testing.T, c *testutil.Child, cmd fdCmd) fdReply {
	t.Helper()
	return askHelper[fdReply](t, c, cmd.Op, cmd)
}

func readShareable(t *testing.T, b *cudaipc.ShareableBuffer) []byte {
	t.Helper()
	got := make([]byte, b.Size())
	if _, err := b.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	return got
}

// shareWith exports b, sends the descriptor to an importer helper and has
// it import size bytes; it checks the helper saw b's bytes.
func shareWith(t *testing.T, b *cudaipc.ShareableBuffer, c *testutil.Child, sock *os.File, size int64) fdReply {
	t.Helper()
	f, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	if err := sendFD(sock, f); err != nil {
		t.Fatal(err)
	}
	f.Close() // the helper's received copy is a reference of its own
	r := ask(t, c, fdCmd{Op: "import", Size: size})
	if r.Size != b.Size() {
		t.Fatalf("helper mapped %d bytes, want %d", r.Size, b.Size())
	}
	if r.Sum != testutil.Sum(readShareable(t, b)) {
		t.Fatal("helper read other bytes than the exporter wrote")
	}
	return r
}

// TestFDShareAcrossProcesses: a helper process imports a descriptor sent
// over SCM_RIGHTS and reads the exporter's bytes; the exporter reads the
// helper's writes; the helper's mapping stays valid after the exporter
// frees its allocation; Close is idempotent and leaves nothing live.
func TestFDShareAcrossProcesses(t *testing.T) {
	dev := testutil.RequireGPU(t)
	const size = 8<<20 + 17 // not a multiple of the granularity
	b, err := dev.AllocShareable(size)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if g := b.Granularity(); g <= 0 || b.Size()%g != 0 || b.Size() < size || b.Size()-size >= g {
		t.Fatalf("size %d, granularity %d: not the rounded-up size", b.Size(), g)
	}
	t.Logf("granularity %d, size %d -> %d", b.Granularity(), int64(size), b.Size())
	if _, err := b.WriteAt(testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size())), 0); err != nil {
		t.Fatal(err)
	}
	c, sock := fdImporter(t, dev, nil)
	r := shareWith(t, b, c, sock, size)
	if r.Pid == os.Getpid() {
		t.Fatal("the importer ran in the test process")
	}

	// The other direction: the helper writes, the exporter reads.
	seed := uint64(time.Now().UnixNano()) + 1
	want := testutil.RandomBytes(seed, int(b.Size()))
	ask(t, c, fdCmd{Op: "write", Seed: seed})
	if string(readShareable(t, b)) != string(want) {
		t.Fatal("the exporter does not see the importer's writes")
	}

	// The exporter frees: its mapping and handle go, the importer's mapping
	// holds a reference of its own to the physical memory.
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatalf("second Free: %v", err)
	}
	if r := ask(t, c, fdCmd{Op: "read"}); r.Sum != testutil.Sum(want) {
		t.Fatal("the importer's mapping changed after the exporter freed")
	}
	seed++
	if r := ask(t, c, fdCmd{Op: "write", Seed: seed}); r.Sum != testutil.Sum(testutil.RandomBytes(seed, int(b.Size()))) {
		t.Fatal("the importer cannot write its mapping after the exporter freed")
	}
	if r := ask(t, c, fdCmd{Op: "close"}); r.Live != (cudaipc.Live{}) {
		t.Fatalf("importer live objects after Close: %+v", r.Live)
	}
}

// TestFDShareIntoNewPIDNamespace is the container case: the importer runs
// in a new PID namespace (where legacy IPC handles do not open, see
// TestLegacyIPCFailsInNewPIDNamespace) and still maps, reads and writes the
// memory through the descriptor.
func TestFDShareIntoNewPIDNamespace(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if os.Geteuid() != 0 {
		t.Skip("creating a PID namespace needs root (CAP_SYS_ADMIN); the GPU machine runs tests as root")
	}
	b, err := dev.AllocShareable(4 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if _, err := b.WriteAt(testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size())), 0); err != nil {
		t.Fatal(err)
	}
	attr, env := testutil.NewNamespaces()
	c, sock := fdImporter(t, dev, attr, env)
	r := shareWith(t, b, c, sock, b.Size())
	requireNewPIDNamespace(t, r.Pid, r.PidNS)
	checkWritesFromNamespace(t, b,
		func(seed uint64) { ask(t, c, fdCmd{Op: "write", Seed: seed}) },
		func() cudaipc.Live { return ask(t, c, fdCmd{Op: "close"}).Live })
}

// checkWritesFromNamespace checks an importer of b in a new PID namespace:
// it writes all of b from a fresh seed (write sends it that command), the
// exporter reads exactly those bytes, and after closeImporter, which
// returns the importer's live objects after its Close, it holds none.
func checkWritesFromNamespace(t *testing.T, b *cudaipc.ShareableBuffer, write func(seed uint64), closeImporter func() cudaipc.Live) {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	write(seed)
	if string(readShareable(t, b)) != string(testutil.RandomBytes(seed, int(b.Size()))) {
		t.Fatal("the exporter does not see the writes of the importer in the other PID namespace")
	}
	if l := closeImporter(); l != (cudaipc.Live{}) {
		t.Fatalf("importer live objects after Close: %+v", l)
	}
}

// TestLegacyIPCInNestedPIDNamespace records a driver fact (580, H200): a
// legacy handle DOES open in a PID namespace nested inside the exporter's,
// with its own /proc, and reads the right bytes. (Sibling containers are
// the case that fails in the field; Region.Import refuses any namespace
// mismatch unless WithAnyPIDNamespace is given.)
func TestLegacyIPCInNestedPIDNamespace(t *testing.T) {
	dev := testutil.RequireGPU(t)
	if os.Geteuid() != 0 {
		t.Skip("creating a PID namespace needs root (CAP_SYS_ADMIN); the GPU machine runs tests as root")
	}
	buf, err := dev.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), 1<<20)
	if _, err := buf.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	h, err := buf.MemHandle()
	if err != nil {
		t.Fatal(err)
	}
	text, _ := h.MarshalText()
	attr, env := testutil.NewNamespaces()
	c := testutil.SpawnWith(t, "importer", testutil.SpawnOptions{
		Env:         []string{"HANDLE=" + string(text), "SIZE=1048576", env},
		SysProcAttr: attr,
	})
	var r map[string]string
	if err := c.Recv(&r); err != nil {
		t.Fatalf("importer: %v\n%s", err, c.Stderr())
	}
	if r["err"] != "" || r["sum"] != testutil.Sum(data) {
		t.Fatalf("legacy IPC in a nested PID namespace: %v", r)
	}
}

// TestFDImportInExportingProcess: unlike legacy IPC, a process may import
// its own export; each ExportFD is a new close-on-exec descriptor, and two
// imports of one descriptor are two mappings of the same memory.
func TestFDImportInExportingProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	before := cudaipc.LiveObjects()
	b, err := dev.AllocShareable(1)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if l := cudaipc.LiveObjects(); l.ShareableBuffers != before.ShareableBuffers+1 {
		t.Fatalf("live shareable buffers %d, want %d", l.ShareableBuffers, before.ShareableBuffers+1)
	}
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size()))
	if _, err := b.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	f1, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer f1.Close()
	f2, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Close()
	if f1.Fd() == f2.Fd() {
		t.Fatal("two exports returned one descriptor")
	}
	for _, f := range []*os.File{f1, f2} {
		flags, err := unix.FcntlInt(f.Fd(), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC == 0 {
			t.Fatalf("exported descriptor flags %#x (%v): not close-on-exec", flags, err)
		}
	}
	m1, err := dev.ImportFD(f1, b.Size())
	if err != nil {
		t.Fatal(err)
	}
	defer m1.Close()
	m2, err := dev.ImportFD(f1, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer m2.Close()
	if m1.Ptr() == m2.Ptr() || m1.Ptr() == b.Ptr() {
		t.Fatalf("mappings at %#x, %#x, buffer at %#x: want three addresses", m1.Ptr(), m2.Ptr(), b.Ptr())
	}
	if m2.Size() != b.Size() {
		t.Fatalf("import of 1 byte mapped %d, want the granularity %d", m2.Size(), b.Size())
	}
	got := make([]byte, m1.Size())
	if _, err := m1.ReadAt(got, 0); err != nil || string(got) != string(data) {
		t.Fatalf("mapping reads other bytes (%v)", err)
	}
	if _, err := m2.WriteAt([]byte("hello"), 100); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ReadAt(got[:5], 100); err != nil || string(got[:5]) != "hello" {
		t.Fatalf("buffer reads %q after a write through a mapping (%v)", got[:5], err)
	}
	if l := cudaipc.LiveObjects(); l.FDMappings != before.FDMappings+2 {
		t.Fatalf("live fd mappings %d, want %d", l.FDMappings, before.FDMappings+2)
	}
	for _, m := range []*cudaipc.Mapping{m1, m2} {
		if err := m.Close(); err != nil {
			t.Fatal(err)
		}
		if err := m.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
	}
	if _, err := m1.ReadAt(got, 0); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("ReadAt after Close: %v, want ErrClosed", err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if _, err := b.ExportFD(); !errors.Is(err, cudaipc.ErrClosed) {
		t.Fatalf("ExportFD after Free: %v, want ErrClosed", err)
	}
	if l := cudaipc.LiveObjects(); l != before {
		t.Fatalf("live objects %+v, want %+v", l, before)
	}
}

// TestFDOutlivesExporterFree: an exported descriptor keeps the physical
// memory alive: imported after the exporter freed, it still maps the bytes.
func TestFDOutlivesExporterFree(t *testing.T) {
	dev := testutil.RequireGPU(t)
	b, err := dev.AllocShareable(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	data := testutil.RandomBytes(uint64(time.Now().UnixNano()), int(b.Size()))
	if _, err := b.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	f, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	size := b.Size()
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	m, err := dev.ImportFD(f, size)
	if err != nil {
		t.Fatalf("import after the exporter freed: %v", err)
	}
	defer m.Close()
	got := make([]byte, size)
	if _, err := m.ReadAt(got, 0); err != nil || string(got) != string(data) {
		t.Fatalf("bytes differ after the exporter freed (%v)", err)
	}
}

// TestFDOutlivesExporterProcess: the exporter process exits (without
// freeing) after sending the descriptor; the importer imports afterwards
// and reads the bytes.
func TestFDOutlivesExporterProcess(t *testing.T) {
	dev := testutil.RequireGPU(t)
	c, r, f := startFDExporter(t, dev, 4<<20, 7)
	if err := c.Send(fdCmd{Op: "exit"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(30 * time.Second); err != nil {
		t.Fatal(err)
	}
	m, err := dev.ImportFD(f, r.Size)
	if err != nil {
		t.Fatalf("import after the exporter exited: %v", err)
	}
	defer m.Close()
	got := make([]byte, m.Size())
	if _, err := m.ReadAt(got, 0); err != nil || testutil.Sum(got) != r.Sum {
		t.Fatalf("bytes differ after the exporter exited (%v)", err)
	}
}

// TestFDImportErrors: descriptors that are not CUDA exports, and sizes the
// allocation cannot hold, are typed errors, not crashes, and leak nothing.
func TestFDImportErrors(t *testing.T) {
	dev := testutil.RequireGPU(t)
	before := cudaipc.LiveObjects()
	b, err := dev.AllocShareable(2 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	f, err := b.ExportFD()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()

	// Larger than the allocation: cuMemMap refuses (the H200 driver 580
	// says CUDA_ERROR_NOT_SUPPORTED), and the message suggests why.
	_, err = dev.ImportFD(f, b.Size()+1)
	var ce *cudaipc.Error
	if !errors.As(err, &ce) || !errors.Is(err, cudaipc.ErrNotSupported) || !strings.Contains(err.Error(), "larger than the exported allocation") {
		t.Errorf("import of %d bytes of a %d-byte allocation: %v, want a driver ErrNotSupported with a hint", b.Size()+1, b.Size(), err)
	}
	t.Logf("too large: %v", err)

	memfd, err := unix.MemfdCreate("not-cuda", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	mf := os.NewFile(uintptr(memfd), "memfd")
	defer mf.Close()
	if err := mf.Truncate(4 << 20); err != nil {
		t.Fatal(err)
	}
	devnull, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer devnull.Close()
	for _, nf := range []*os.File{mf, devnull} {
		// Observed on the H200 (driver 580): CUDA_ERROR_UNKNOWN.
		_, err := dev.ImportFD(nf, 2<<20)
		if !errors.As(err, &ce) || !strings.Contains(err.Error(), "cuMemImportFromShareableHandle") {
			t.Errorf("import of %s: %v, want a *cudaipc.Error from cuMemImportFromShareableHandle", nf.Name(), err)
			continue
		}
		t.Logf("import of %s: %v", nf.Name(), err)
	}

	closed, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	closed.Close()
	var ae *cudaipc.ArgError
	for _, nf := range []*os.File{nil, closed, os.NewFile(987654, "garbage")} {
		if _, err := dev.ImportFD(nf, 2<<20); !errors.As(err, &ae) {
			t.Errorf("import of %v: %v, want *ArgError", nf, err)
		}
	}
	// The good descriptor still imports after all that.
	m, err := dev.ImportFD(f, b.Size())
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := b.Free(); err != nil {
		t.Fatal(err)
	}
	if l := cudaipc.LiveObjects(); l != before {
		t.Fatalf("live objects %+v, want %+v", l, before)
	}
}

// BenchmarkFDImportMap imports and maps a descriptor exported by another
// process (cuMemImportFromShareableHandle, cuMemAddressReserve, cuMemMap,
// cuMemSetAccess), then closes the mapping, for a 1 MiB (one granule) and
// a 1 GiB allocation. NCCL reports 30-40 ms an import on H100.
func BenchmarkFDImportMap(b *testing.B) {
	for _, size := range []int64{1 << 20, 1 << 30} {
		b.Run(sizeName(size), func(b *testing.B) {
			dev := testutil.RequireGPU(b)
			_, r, f := startFDExporter(b, dev, size, 1)
			var imp, cls timer
			for b.Loop() {
				var m *cudaipc.Mapping
				imp.time(func() {
					var err error
					if m, err = dev.ImportFD(f, r.Size); err != nil {
						b.Fatal(err)
					}
				})
				cls.time(func() {
					if err := m.Close(); err != nil {
						b.Fatal(err)
					}
				})
			}
			imp.report(b, "import+map")
			cls.report(b, "close")
		})
	}
}

func sizeName(n int64) string {
	switch {
	case n >= 1<<30:
		return strconv.FormatInt(n>>30, 10) + "GiB"
	case n >= 1<<20:
		return strconv.FormatInt(n>>20, 10) + "MiB"
	}
	return strconv.FormatInt(n, 10) + "B"
}
