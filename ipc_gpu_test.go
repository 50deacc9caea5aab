package cudaipc_test

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// exportMsg is what the exporter role reports after allocating.
type exportMsg struct {
	Handle      cudaipc.MemHandle
	EventHandle cudaipc.EventHandle
	Size        int64
	Sum         string
	UUID        cudaipc.UUID
	Pid         int
	Err         string
}

// cmd is what the test tells a helper to do next.
type cmd struct {
	Op   string // "write", "exit", "free"
	Seed uint64
}

// roleExporter allocates SIZE bytes on the device with UUID DEVICE (default
// ordinal 0), fills them from SEED, exports the allocation and an IPC event,
// and then obeys commands.
func roleExporter(p *testutil.Peer) error {
	dev, err := helperDevice()
	if err != nil {
		return p.Send(exportMsg{Err: err.Error()})
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	buf, err := dev.Alloc(size)
	if err != nil {
		return err
	}
	data := testutil.RandomBytes(seed, int(size))
	if _, err := buf.WriteAt(data, 0); err != nil {
		return err
	}
	h, err := buf.MemHandle()
	if err != nil {
		return err
	}
	ev, err := dev.NewIPCEvent()
	if err != nil {
		return err
	}
	eh, err := ev.IPCHandle()
	if err != nil {
		return err
	}
	if err := p.Send(exportMsg{Handle: h, EventHandle: eh, Size: size, Sum: testutil.Sum(data), UUID: dev.UUID(), Pid: os.Getpid()}); err != nil {
		return err
	}
	late, err := newLateWriter(dev)
	if err != nil {
		return err
	}
	for {
		var c cmd
		if err := p.Recv(&c); err != nil {
			return nil // the test closed stdin or died
		}
		switch c.Op {
		case "write":
			if err := late.write(p, buf.Ptr(), size, c.Seed, ev.Record); err != nil {
				return err
			}
		case "exit":
			os.Exit(0) // without freeing: the driver cleans up as on a crash
		default:
			return fmt.Errorf("unknown command %q", c.Op)
		}
	}
}

// lateWriter queues a write of random bytes behind ~20 GiB of copies on a
// stream, so that the write lands well after the exporter has told the
// test it was queued: only an event can then order the test's read.
type lateWriter struct {
	dev               *cudaipc.Device
	stream            *cudaipc.Stream
	scratch, scratch2 *cudaipc.Buffer
}

// newLateWriter makes the stream and the two scratch buffers whose copies
// keep it busy.
func newLateWriter(dev *cudaipc.Device) (lateWriter, error) {
	w := lateWriter{dev: dev}
	var err error
	if w.stream, err = dev.NewStream(); err != nil {
		return w, err
	}
	if w.scratch, err = dev.Alloc(512 << 20); err != nil {
		return w, err
	}
	w.scratch2, err = dev.Alloc(512 << 20)
	return w, err
}

// close frees what newLateWriter made.
func (w lateWriter) close() {
	for _, b := range []*cudaipc.Buffer{w.scratch, w.scratch2} {
		if b != nil {
			b.Free()
		}
	}
	if w.stream != nil {
		w.stream.Close()
	}
}

// write queues the busy copies and the write of size bytes from seed at
// dst, then signal on the stream (an event record or a counter), tells
// the test {"queued": "yes"} through p, and waits for the stream.
func (w lateWriter) write(p *testutil.Peer, dst cudaipc.DevicePtr, size int64, seed uint64, signal func(*cudaipc.Stream) error) error {
	host, err := w.dev.AllocHost(size)
	if err != nil {
		return err
	}
	defer host.Free()
	copy(host.Bytes(), testutil.RandomBytes(seed, int(size)))
	for i := 0; i < 40; i++ {
		if err := w.stream.CopyAsync(w.scratch2.Ptr(), w.scratch.Ptr(), w.scratch.Size()); err != nil {
			return err
		}
	}
	if err := w.stream.CopyToDeviceAsync(dst, host.Bytes()); err != nil {
		return err
	}
	if err := signal(w.stream); err != nil {
		return err
	}
	if err := p.Send(map[string]string{"queued": "yes"}); err != nil {
		return err
	}
	return w.stream.Synchronize()
}

// roleImporter opens HANDLE on its device 0 and reports the bytes' hash.
func roleImporter(p *testutil.Peer) error {
	var h cudaipc.MemHandle
	if err := h.UnmarshalText([]byte(os.Getenv("HANDLE"))); err != nil {
		return err
	}
	size, _ := strconv.ParseInt(os.Getenv("SIZE"), 10, 64)
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		return err
	}
	n, _ := cudaipc.DeviceCount()
	ptr, err := dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		return p.Send(map[string]string{"err": err.Error()})
	}
	got := make([]byte, size)
	if err := dev.CopyFromDevice(got, ptr); err != nil {
		return err
	}
	if err := dev.CloseMemHandle(ptr); err != nil {
		return err
	}
	return p.Send(map[string]string{"sum": testutil.Sum(got), "visible": strconv.Itoa(n), "uuid": dev.UUID().String()})
}

func helperDevice() (*cudaipc.Device, error) {
	if s := os.Getenv("DEVICE"); s != "" {
		u, err := cudaipc.ParseUUID(s)
		if err != nil {
			return nil, err
		}
		return cudaipc.DeviceByUUID(u)
	}
	return cudaipc.DeviceByOrdinal(0)
}

// helperReply is the reply of a helper role that carries the helper's
// own failure as text.
type helperReply interface{ helperErr() string }

func (m exportMsg) helperErr() string     { return m.Err }
func (m regionMsg) helperErr() string     { return m.Err }
func (r fdReply) helperErr() string       { return r.Err }
func (r fdRegionReply) helperErr() string { return r.Err }

// recvReply receives a reply from c and fails the test when receiving it
// fails or the helper reports a failure; what names the step in messages.
func recvReply[R helperReply](t testing.TB, c *testutil.Child, what string) R {
	t.Helper()
	var r R
	if err := c.Recv(&r); err != nil {
		t.Fatalf("%s: %v\n%s", what, err, c.Stderr())
	}
	if e := r.helperErr(); e != "" {
		t.Fatalf("helper %s: %s", what, e)
	}
	return r
}

// askHelper sends cmd to c and receives the reply as recvReply does.
func askHelper[R helperReply](t testing.TB, c *testutil.Child, what string, cmd any) R {
	t.Helper()
	if err := c.Send(cmd); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return recvReply[R](t, c, what)
}

// exporterEnv is the environment of an exporter role: SIZE bytes on dev
// filled from SEED, then the caller's env.
func exporterEnv(dev *cudaipc.Device, size int64, seed uint64, env []string) []string {
	return append([]string{"SIZE=" + strconv.FormatInt(size, 10), "SEED=" + strconv.FormatUint(seed, 10), "DEVICE=" + dev.UUID().String()}, env...)
}

func startExporter(t testing.TB, dev *cudaipc.Device, size int64, seed uint64, env ...string) (*testutil.Child, exportMsg) {
	t.Helper()
	c := testutil.Spawn(t, "exporter", exporterEnv(dev, size, seed, env)...)
	return c, recvReply[exportMsg](t, c, "exporter")
}

func readAll(t *testing.T, dev *cudaipc.Device, p cudaipc.DevicePtr, n int64) []byte {
	t.Helper()
	b := make([]byte, n)
	if err := dev.CopyFromDevice(b, p); err != nil {
		t.Fatal(err)
	}
	return b
}

func TestIPCReadsExportersBytes(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 8<<20 + 4096 + 17 // not a power of two
	_, m := startExporter(t, dev, size, seed)
	if m.Pid == os.Getpid() {
		t.Fatal("exporter ran in the test process")
	}
	p, err := dev.OpenMemHandle(m.Handle) // the default flags: LazyEnablePeerAccess
	if err != nil {
		t.Fatal(err)
	}
	defer dev.CloseMemHandle(p)
	got := readAll(t, dev, p, size)
	if testutil.Sum(got) != m.Sum {
		t.Fatal("imported bytes differ from the exporter's")
	}
	want := testutil.RandomBytes(seed, size)
	if string(got[size-4096:]) != string(want[size-4096:]) {
		t.Fatal("tail differs")
	}
}

func TestIPCOpenTwiceSamePointerTwoCloses(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 1 << 20
	_, m := startExporter(t, dev, size, seed)
	p1, err := dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		t.Fatal(err)
	}
	if p1 != p2 {
		t.Fatalf("second open gave %#x, first %#x", p2, p1)
	}
	if err := dev.CloseMemHandle(p1); err != nil {
		t.Fatal(err)
	}
	// One open is left: the memory must still be mapped and readable.
	if testutil.Sum(readAll(t, dev, p2, size)) != m.Sum {
		t.Fatal("bytes changed after the first close")
	}
	if err := dev.CloseMemHandle(p2); err != nil {
		t.Fatal(err)
	}
	// The mapping is gone: a third close names a pointer that is not mapped.
	if err := dev.CloseMemHandle(p2); !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("third close: %v, want ErrInvalidValue", err)
	}
}

func TestIPCOpenInExporterIsTypedError(t *testing.T) {
	dev := testutil.RequireGPU(t)
	buf, err := dev.Alloc(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer buf.Free()
	h, err := buf.MemHandle()
	if err != nil {
		t.Fatal(err)
	}
	_, err = dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
	if !errors.Is(err, cudaipc.ErrDeviceUninitialized) {
		t.Fatalf("open in exporter: %v, want ErrDeviceUninitialized", err)
	}
	if !strings.Contains(err.Error(), "cuIpcOpenMemHandle") {
		t.Fatalf("error %q does not name the call", err)
	}
	// Interior pointers export the same handle as the base.
	h2, err := dev.GetMemHandle(buf.Ptr() + 4096)
	if err != nil {
		t.Fatal(err)
	}
	if h2 != h {
		t.Fatal("interior pointer exported a different handle")
	}
}

func TestIPCGarbageHandles(t *testing.T) {
	dev := testutil.RequireGPU(t)
	for i := 0; i < 8; i++ {
		h := cudaipc.MemHandle(testutil.RandomBytes(uint64(time.Now().UnixNano())+uint64(i), 64))
		_, err := dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
		if !errors.Is(err, cudaipc.ErrInvalidValue) {
			t.Fatalf("garbage handle: %v, want ErrInvalidValue", err)
		}
	}
	_, err := dev.OpenMemHandle(cudaipc.MemHandle{}, cudaipc.LazyEnablePeerAccess)
	if !errors.Is(err, cudaipc.ErrInvalidValue) {
		t.Fatalf("zero handle: %v", err)
	}
	_, err = dev.OpenEventHandle(cudaipc.EventHandle(testutil.RandomBytes(uint64(time.Now().UnixNano()), 64)))
	if !errors.Is(err, cudaipc.ErrMapBufferObjectFailed) {
		t.Fatalf("garbage event handle: %v, want ErrMapBufferObjectFailed", err)
	}
}

func TestIPCEventOrdersImporterAfterExporterWrite(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seedA, seedB := uint64(time.Now().UnixNano()), uint64(time.Now().UnixNano())^0xabcdef
	const size = 4 << 20
	c, m := startExporter(t, dev, size, seedA)
	p, err := dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		t.Fatal(err)
	}
	defer dev.CloseMemHandle(p)
	ev, err := dev.OpenEventHandle(m.EventHandle)
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	if !ev.Imported() {
		t.Fatal("opened event not marked imported")
	}
	readAfterLateWrite(t, dev, c, p, size, m.Sum, seedB, func(s *cudaipc.Stream) error { return s.WaitEvent(ev) })
}

// readAfterLateWrite asks the exporter c to rewrite its size bytes from
// seed behind a busy stream and to signal its IPC event, makes a stream of
// dev wait through wait, and copies from p on it: the copy must hold the
// new bytes, not the old ones (oldSum), which only the event ensures.
func readAfterLateWrite(t *testing.T, dev *cudaipc.Device, c *testutil.Child, p cudaipc.DevicePtr, size int64, oldSum string, seed uint64, wait func(*cudaipc.Stream) error) {
	t.Helper()
	s, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	host, err := dev.AllocHost(size)
	if err != nil {
		t.Fatal(err)
	}
	defer host.Free()
	if err := c.Send(cmd{Op: "write", Seed: seed}); err != nil {
		t.Fatal(err)
	}
	var ack map[string]string
	if err := c.Recv(&ack); err != nil || ack["queued"] != "yes" {
		t.Fatalf("exporter: %v %v\n%s", err, ack, c.Stderr())
	}
	if err := wait(s); err != nil {
		t.Fatal(err)
	}
	if err := s.CopyFromDeviceAsync(host.Bytes(), p); err != nil {
		t.Fatal(err)
	}
	if err := s.Synchronize(); err != nil {
		t.Fatal(err)
	}
	got := testutil.Sum(host.Bytes())
	if got == oldSum {
		t.Fatal("read the earlier value: the event did not order the read after the write")
	}
	if got != testutil.Sum(testutil.RandomBytes(seed, int(size))) {
		t.Fatal("read neither value")
	}
}

func TestIPCMappingOutlivesExporter(t *testing.T) {
	dev := testutil.RequireGPU(t)
	seed := uint64(time.Now().UnixNano())
	const size = 2 << 20
	c, m := startExporter(t, dev, size, seed)
	p, err := dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Send(cmd{Op: "exit"}); err != nil {
		t.Fatal(err)
	}
	if err := c.Wait(30 * time.Second); err != nil {
		t.Fatalf("exporter exit: %v", err)
	}
	if testutil.Sum(readAll(t, dev, p, size)) != m.Sum {
		t.Fatal("mapping changed after the exporter exited")
	}
	if err := dev.CloseMemHandle(p); err != nil {
		t.Fatalf("close after exporter exit: %v", err)
	}
	_, err = dev.OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if !errors.Is(err, cudaipc.ErrInvalidResourceHandle) {
		t.Fatalf("new open after exporter exit: %v, want ErrInvalidResourceHandle", err)
	}
}

func TestIPCHandleFromOtherGPU(t *testing.T) {
	devs := testutil.RequireGPUs(t, 2)
	ok, err := devs[0].CanAccessPeer(devs[1])
	if err != nil || !ok {
		t.Fatalf("GPU 0 cannot access GPU 1: %v", err)
	}
	if err := devs[0].EnablePeerAccess(devs[1]); err != nil {
		t.Fatal(err)
	}
	if err := devs[0].EnablePeerAccess(devs[1]); err != nil {
		t.Fatalf("enabling twice: %v", err)
	}
	seed := uint64(time.Now().UnixNano())
	const size = 16 << 20
	_, m := startExporter(t, devs[1], size, seed)
	if m.UUID != devs[1].UUID() {
		t.Fatalf("exporter used %s, want %s", m.UUID, devs[1].UUID())
	}
	p, err := devs[0].OpenMemHandle(m.Handle, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		t.Fatal(err)
	}
	defer devs[0].CloseMemHandle(p)
	// Copy GPU1 -> GPU0 inside GPU 0's context, then read from GPU 0.
	local, err := devs[0].Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer local.Free()
	if err := devs[0].Copy(local.Ptr(), p, size); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, size)
	if _, err := local.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	if testutil.Sum(got) != m.Sum {
		t.Fatal("bytes from GPU 1 differ")
	}

	// A process that sees only GPU 0 opens the handle of GPU 1.
	text, _ := m.Handle.MarshalText()
	imp := testutil.Spawn(t, "importer", "HANDLE="+string(text), "SIZE="+strconv.Itoa(size),
		"CUDA_VISIBLE_DEVICES="+devs[0].UUID().String())
	var r map[string]string
	if err := imp.Recv(&r); err != nil {
		t.Fatalf("importer: %v\n%s", err, imp.Stderr())
	}
	if r["err"] != "" {
		t.Fatalf("importer with GPU 1 hidden: %s", r["err"])
	}
	if r["visible"] != "1" || r["uuid"] != devs[0].UUID().String() {
		t.Fatalf("importer saw %s device(s), device 0 = %s", r["visible"], r["uuid"])
	}
	if r["sum"] != m.Sum {
		t.Fatal("importer with GPU 1 hidden read different bytes")
	}
}

func roleNoDriver(p *testutil.Peer) error {
	_, err := cudaipc.DeviceCount()
	msg := map[string]any{"nodriver": errors.Is(err, cudaipc.ErrNoDriver)}
	if err != nil {
		msg["err"] = err.Error()
	}
	return p.Send(msg)
}

func TestMissingDriverIsClearError(t *testing.T) {
	c := testutil.Spawn(t, "nodriver", cudaipc.EnvLibrary+"=/nonexistent/libcuda.so.1")
	var r map[string]any
	if err := c.Recv(&r); err != nil {
		t.Fatalf("%v\n%s", err, c.Stderr())
	}
	if r["nodriver"] != true {
		t.Fatalf("error does not match ErrNoDriver: %v", r["err"])
	}
	msg, _ := r["err"].(string)
	for _, want := range []string{"cuDeviceGetCount", "/nonexistent/libcuda.so.1", "install the NVIDIA driver"} {
		if !strings.Contains(msg, want) {
			t.Errorf("%q lacks %q", msg, want)
		}
	}
}

func TestLibraryWithoutEntryPointsIsClearError(t *testing.T) {
	// libc loads fine but has no CUDA entry points: the error must say so.
	c := testutil.Spawn(t, "nodriver", cudaipc.EnvLibrary+"=libc.so.6")
	var r map[string]any
	if err := c.Recv(&r); err != nil {
		t.Fatalf("%v\n%s", err, c.Stderr())
	}
	msg, _ := r["err"].(string)
	if r["nodriver"] != true || !strings.Contains(msg, "lacks cuInit") || !strings.Contains(msg, "libc.so.6") {
		t.Fatalf("error %q (matches ErrNoDriver: %v)", msg, r["nodriver"])
	}
}
