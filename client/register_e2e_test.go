package client_test

// Registered memory across sibling containers (docs/containers.md): an
// exporter registers VMM memory it allocated, and a Timeline, in one
// container; a reader in another maps them read-only through the daemon
// in a third, waits on the Timeline for a late write, and keeps reading
// after the exporter exits.

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/protocol"
)

func init() {
	ownDialRoles["ext-exporter"] = roleExtExporter
	ownDialRoles["ext-reader"] = roleExtReader
	ownDialRoles["ext-legacy-exporter"] = roleExtLegacyExporter
}

const (
	extSize = 4<<20 + 7 // the registered range, from 1 MiB into a 6 MiB allocation
	extOff  = 1 << 20
)

func stdinLines() *bufio.Scanner { return bufio.NewScanner(os.Stdin) }

// roleExtExporter registers NAME (VMM memory holding random bytes from
// SEED) and NAME/timeline; on "write" it queues a write of bytes from
// SEED+1 behind tens of GiB of copies, then Signal(1), and says "queued";
// on "exit" it exits without freeing anything.
func roleExtExporter(ctx context.Context, sock string, say func(string, ...any)) error {
	seed, _ := strconv.ParseUint(os.Getenv("SEED"), 10, 64)
	name := os.Getenv("NAME")
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		return err
	}
	c, err := client.Dial(ctx, sock)
	if err != nil {
		return err
	}
	data, err := dev.AllocShareable(6 << 20)
	if err != nil {
		return err
	}
	if _, err := data.WriteAt(testutil.RandomBytes(seed, int(data.Size())), 0); err != nil {
		return err
	}
	tl, err := dev.NewTimeline()
	if err != nil {
		return err
	}
	for _, r := range []struct {
		name string
		ptr  cudaipc.DevicePtr
		size int64
	}{{name, data.Ptr() + extOff, extSize}, {name + "/timeline", tl.Ptr(), 8}} {
		reg, files, err := cudaipc.ExportPointer(dev, r.ptr, r.size)
		if err != nil {
			return err
		}
		if reg.Kind != cudaipc.KindVMMFD {
			return fmt.Errorf("%s exported as a legacy region", r.name)
		}
		_, err = c.Register(ctx, r.name, reg, files, client.RegisterOptions{Shared: true})
		for _, f := range files {
			f.Close()
		}
		if err != nil {
			return err
		}
	}
	say("registered")
	in := stdinLines()
	for in.Scan() {
		switch in.Text() {
		case "write":
			s, err := dev.NewStream()
			if err != nil {
				return err
			}
			a, err := dev.Alloc(512 << 20)
			if err != nil {
				return err
			}
			b, err := dev.Alloc(512 << 20)
			if err != nil {
				return err
			}
			host, err := dev.AllocHost(extSize)
			if err != nil {
				return err
			}
			copy(host.Bytes(), testutil.RandomBytes(seed+1, extSize))
			for i := 0; i < 60; i++ {
				if err := s.CopyAsync(b.Ptr(), a.Ptr(), a.Size()); err != nil {
					return err
				}
			}
			if err := s.CopyToDeviceAsync(data.Ptr()+extOff, host.Bytes()); err != nil {
				return err
			}
			if err := tl.Signal(s, 1); err != nil {
				return err
			}
			say("queued")
			if err := s.Synchronize(); err != nil {
				return err
			}
		case "exit":
			os.Exit(0) // no Free, no Close: as a crash would
		}
	}
	return nil
}

// roleExtReader leases NAME and NAME/timeline, reports the bytes' hash and
// what a memset through the read-only mapping did; on "read" it waits on
// the timeline for 1 on a stream, copies the range on that stream and
// reports the hash; on "again" it reads and reports once more; on
// "release" it releases both leases.
func roleExtReader(ctx context.Context, sock string, say func(string, ...any)) error {
	name := os.Getenv("NAME")
	c, err := client.Dial(ctx, sock)
	if err != nil {
		return err
	}
	defer c.Close()
	l, err := c.Get(ctx, name)
	if err != nil {
		return err
	}
	lt, err := c.Get(ctx, name+"/timeline")
	if err != nil {
		return err
	}
	dev := l.CUDADevice()
	read := func() string {
		b := make([]byte, l.Size())
		if _, err := l.ReadAt(b, 0); err != nil {
			return "err " + err.Error()
		}
		return testutil.Sum(b)
	}
	merr := dev.Memset(l.Ptr(), 0, l.Size())
	say("leased %s memset-err=%t ptr-nonzero=%t info-external=%t", read(), merr != nil, l.Ptr() != 0, l.Info().External)
	tl, err := dev.TimelineAt(lt.Ptr())
	if err != nil {
		return err
	}
	in := stdinLines()
	for in.Scan() {
		switch in.Text() {
		case "read":
			s, err := dev.NewStream()
			if err != nil {
				return err
			}
			dst, err := dev.Alloc(l.Size())
			if err != nil {
				return err
			}
			if err := tl.Wait(s, 1); err != nil {
				return err
			}
			if err := s.CopyAsync(dst.Ptr(), l.Ptr(), l.Size()); err != nil {
				return err
			}
			if err := s.Synchronize(); err != nil {
				return err
			}
			b := make([]byte, l.Size())
			if _, err := dst.ReadAt(b, 0); err != nil {
				return err
			}
			say("read %s", testutil.Sum(b))
		case "again":
			say("again %s", read())
		case "release":
			if err := errors.Join(lt.Release(), l.Release()); err != nil {
				return err
			}
			say("released")
		}
	}
	return nil
}

// roleExtLegacyExporter registers NAME, cudaMalloc memory (a legacy
// region), and holds it until stdin closes.
func roleExtLegacyExporter(ctx context.Context, sock string, say func(string, ...any)) error {
	dev, err := cudaipc.DeviceByOrdinal(0)
	if err != nil {
		return err
	}
	c, err := client.Dial(ctx, sock)
	if err != nil {
		return err
	}
	defer c.Close()
	b, err := dev.Alloc(1 << 20)
	if err != nil {
		return err
	}
	reg, files, err := cudaipc.ExportPointer(dev, b.Ptr(), 1<<20)
	if err != nil {
		return err
	}
	if reg.Kind != cudaipc.KindCUDAIPC || len(files) != 0 {
		return errors.New("cudaMalloc memory exported as VMM")
	}
	if _, err := c.Register(ctx, os.Getenv("NAME"), reg, nil, client.RegisterOptions{Shared: true}); err != nil {
		return err
	}
	say("registered")
	in := stdinLines()
	for in.Scan() {
	}
	return nil
}

// roleGetter reports how a get of NAME went, in one line.
func init() {
	ownDialRoles["getter"] = func(ctx context.Context, sock string, say func(string, ...any)) error {
		c, err := client.Dial(ctx, sock)
		if err != nil {
			return err
		}
		defer c.Close()
		l, err := c.Get(ctx, os.Getenv("NAME"))
		if err != nil {
			say("err %s", strconv.Quote(err.Error()))
			return nil
		}
		say("ok")
		return l.Release()
	}
}

// VMM memory registered in one sibling container is read zero-copy and
// read-only in another through a daemon in a third; a Timeline, registered
// the same way, orders the reader after the exporter's late write; the
// reader's mapping survives the exporter's exit, the object shows orphaned
// meanwhile, and the daemon drops it after the last release.
func TestRegisterAcrossContainers(t *testing.T) {
	testutil.RequireGPU(t)
	share, sock := containerDaemon(t, "BACKEND=cuda")
	seed := uint64(os.Getpid())<<20 + 11
	env := []string{"CUDAIPC_SOCKET=" + sock, "NAME=ext/weights", "SEED=" + strconv.FormatUint(seed, 10)}
	exp := spawnIn(t, testutil.Container{Share: share, UID: exporterUID, GID: exporterUID}, "ext-exporter", env...)
	exp.expect("registered")
	// Another uid names the exporter's object UID:NAME.
	qualified := fmt.Sprintf("%d:ext/weights", exporterUID)
	rd := spawnIn(t, testutil.Container{Share: share, UID: readerUID, GID: readerUID}, "ext-reader", append(env, "NAME="+qualified)...)
	old := testutil.RandomBytes(seed, 6<<20)[extOff : extOff+extSize]
	got := rd.expect("leased ")
	if want := testutil.Sum(old) + " memset-err=true ptr-nonzero=true info-external=true"; got != want {
		t.Fatalf("reader: %s\nwant %s", got, want)
	}

	newer := func(string) string { return testutil.Sum(testutil.RandomBytes(seed+1, extSize)) }
	host := checkLateWriteAndExit(t, share, qualified, exp, rd, testutil.Sum(old), newer, func(info client.ObjectInfo) {
		if !info.External || info.Leases != 1 {
			t.Fatalf("orphan %+v", info)
		}
	})
	testutil.Eventually(t, testutil.Wait, func() error {
		if _, err := host.Stat(context.Background(), qualified); !errors.Is(err, client.ErrNotFound) {
			return fmt.Errorf("stat of %s after its last release: %v, want ErrNotFound", qualified, err)
		}
		return nil
	})
}

// checkLateWriteAndExit drives an exporter of qualified (registered memory
// and its Timeline) and a reader that leased both (role ext-reader),
// through the daemon of the container share: the exporter queues a write
// behind a Timeline signal ("write", answered "queued"), and the reader's
// read, ordered by the Timeline, must see the new bytes, whose sum newer
// gives from the rest of the exporter's answer (old is the sum before the
// write); then the exporter exits, the daemon must show the object
// orphaned (orphan checks more of its info), and the reader's mapping must
// still read the new bytes before it releases both leases. It returns a
// client of the daemon.
func checkLateWriteAndExit(t *testing.T, share, qualified string, exp, rd *proc, old string, newer func(queued string) string, orphan func(client.ObjectInfo)) *client.Client {
	t.Helper()
	fmt.Fprintln(exp.in, "write")
	want := newer(exp.expect("queued"))
	fmt.Fprintln(rd.in, "read")
	if got := rd.expect("read "); got != want {
		t.Fatalf("the reader's stream read before the exporter's write landed (old bytes: %t)", got == old)
	}
	host := dial(t, share+"/store.sock")
	fmt.Fprintln(exp.in, "exit")
	<-exp.waited
	testutil.Eventually(t, testutil.Wait, func() error { // the daemon notices the exit asynchronously
		info, err := host.Stat(context.Background(), qualified)
		if err != nil {
			t.Fatal(err)
		}
		if !info.Orphaned {
			return fmt.Errorf("%s not orphaned after its exporter exited: %+v", qualified, info)
		}
		orphan(info)
		return nil
	})
	fmt.Fprintln(rd.in, "again")
	if got := rd.expect("again "); got != want {
		t.Fatal("the reader's mapping changed after the exporter exited")
	}
	fmt.Fprintln(rd.in, "release")
	rd.expect("released")
	return host
}

// A legacy (cudaMalloc) registration cannot be opened from a sibling
// container: the reader gets one line that names the fix.
func TestRegisterLegacyFailsAcrossContainers(t *testing.T) {
	testutil.RequireGPU(t)
	share, sock := containerDaemon(t, "BACKEND=cuda")
	env := []string{"CUDAIPC_SOCKET=" + sock, "NAME=ext/legacy"}
	exp := spawnIn(t, testutil.Container{Share: share, UID: exporterUID, GID: exporterUID}, "ext-legacy-exporter", env...)
	exp.expect("registered")
	got := spawnIn(t, testutil.Container{Share: share, UID: readerUID, GID: readerUID}, "getter", append(env, fmt.Sprintf("NAME=%d:ext/legacy", exporterUID))...).line()
	msg, err := strconv.Unquote(strings.TrimPrefix(got, "err "))
	if !strings.HasPrefix(got, "err ") || err != nil || strings.Contains(msg, "\n") || !strings.Contains(msg, "expandable_segments:True") {
		t.Fatalf("legacy registration read from a sibling container: %s", got)
	}
	t.Logf("the reader's error: %s", msg)
}

func init() {
	// Enters its container (TestMain did) and becomes python3 running
	// PY_SCRIPT, with PYTHONPATH at the repository's python/.
	ownDialRoles["exec-python"] = func(ctx context.Context, sock string, say func(string, ...any)) error {
		py, err := exec.LookPath("python3")
		if err != nil {
			return err
		}
		return syscall.Exec(py, []string{py, "-u", os.Getenv("PY_SCRIPT")}, os.Environ())
	}
}

// pythonWith reports why python3 with cudaipc's requirements and mods
// cannot run here, or "".
func pythonWith(mods ...string) string {
	py, err := exec.LookPath("python3")
	if err != nil {
		return "no python3"
	}
	args := []string{"-c", "import cuda.bindings.driver, google.protobuf\nimport " + strings.Join(mods, ", ")}
	if out, err := exec.Command(py, args...).CombinedOutput(); err != nil {
		return fmt.Sprintf("python3 cannot import %v: %s", mods, strings.TrimSpace(string(out)))
	}
	return ""
}

// requirePython skips the test, or fails it when GPUs are required
// (testutil.EnvRequireGPU), unless python3 can run with mods (pythonWith).
func requirePython(t *testing.T, mods ...string) {
	t.Helper()
	if why := pythonWith(mods...); why != "" {
		if testutil.GPURequired() {
			t.Fatal(why)
		}
		t.Skip(why)
	}
}

// A PyTorch tensor from the expandable-segments allocator, and a CuPy array
// on a VMM allocator, registered by Python in one sibling container, are
// read zero-copy (read-only) by a Go reader in another, ordered after the
// exporter's late write by a Timeline the exporter signals from its
// stream; the reader's mapping survives the exporter's exit.
func TestRegisterTorchCuPyAcrossContainers(t *testing.T) {
	testutil.RequireGPU(t)
	for _, kind := range []string{"torch", "cupy"} {
		t.Run(kind, func(t *testing.T) {
			requirePython(t, kind)
			share, sock := containerDaemon(t, "BACKEND=cuda")
			pydir, _ := filepath.Abs("../python")
			script, _ := filepath.Abs("../scripts/containers/torch_export.py")
			name := "ext/" + kind
			env := []string{"CUDAIPC_SOCKET=" + sock, "NAME=" + name, "KIND=" + kind, "SEED=5",
				"PY_SCRIPT=" + script, "PYTHONPATH=" + pydir, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}
			exp := spawnIn(t, testutil.Container{Share: share, UID: exporterUID, GID: exporterUID}, "exec-python", env...)
			reg := strings.Fields(exp.expect("registered "))
			t.Logf("%s exporter: %v", kind, reg)
			if kind == "torch" && reg[1] == "pieces=1" {
				t.Logf("the torch tensor lies in one physical chunk this time")
			}
			if reg[1] == "pieces=0" {
				t.Fatalf("%s memory was registered as a legacy region", kind)
			}
			qualified := fmt.Sprintf("%d:%s", exporterUID, name)
			rd := spawnIn(t, testutil.Container{Share: share, UID: readerUID, GID: readerUID}, "ext-reader", append(env, "NAME="+qualified)...)
			if got := rd.expect("leased "); got != reg[0]+" memset-err=true ptr-nonzero=true info-external=true" {
				t.Fatalf("reader: %s, want the exporter's %s", got, reg[0])
			}
			// The exporter's "queued" line carries the new bytes' sum.
			newer := func(queued string) string { return queued }
			checkLateWriteAndExit(t, share, qualified, exp, rd, reg[0], newer, func(client.ObjectInfo) {})
		})
	}
}

// A lease of a GPU object of a daemon sharing by descriptor maps it
// read-only: a memset and a copy through the lease fail, and every reader
// still reads what the creator wrote.
func TestGPUFDLeaseIsReadOnly(t *testing.T) {
	d, dev := startFDDaemon(t)
	ctx := context.Background()
	w := dial(t, d.socket)
	const size = 3<<20 + 5
	o, err := w.Create(ctx, "ro", size, client.CreateOptions{Device: dev.UUID().String()})
	if err != nil {
		t.Fatal(err)
	}
	data := testutil.RandomBytes(uint64(os.Getpid()), size)
	if _, err := o.WriteAt(data, 0); err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	r := dial(t, d.socket)
	l, err := r.Get(ctx, "ro")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	merr := dev.Memset(l.Ptr(), 0, size)
	cerr := dev.CopyToDevice(l.Ptr(), make([]byte, 4096))
	t.Logf("through a lease: memset -> %v; copy -> %v", merr, cerr)
	if merr == nil || cerr == nil {
		t.Fatal("a write through a lease succeeded")
	}
	got := make([]byte, size)
	if _, err := l.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	l2, err := dial(t, d.socket).Get(ctx, "ro")
	if err != nil {
		t.Fatal(err)
	}
	defer l2.Release()
	got2 := make([]byte, size)
	if _, err := l2.ReadAt(got2, 0); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data) || !bytes.Equal(got2, data) {
		t.Fatal("the object's bytes changed after a reader's failed writes")
	}
}

// Issue 20's registered read from Python: a 4 GiB PyTorch tensor of
// expandable segments (~205 descriptors: staged on register, fetched by the
// reader beyond the first 60) registered in one container is leased by a
// Python reader in a sibling container (own PID, IPC and mount namespaces,
// uid 65534), read() and the zero-copy tensor both give the exporter's
// bytes, and after the exporter is killed (kill -9) they still do.
func TestRegisterTorchReadFromPythonAcrossContainers(t *testing.T) {
	testutil.RequireGPU(t)
	requirePython(t, "torch")
	share, sock := containerDaemon(t, "BACKEND=cuda")
	pydir, _ := filepath.Abs("../python")
	script, _ := filepath.Abs("../scripts/containers/torch_export.py")
	reader, _ := filepath.Abs("../scripts/containers/py_reader.py")
	const size = 4 << 30
	env := []string{"CUDAIPC_SOCKET=" + sock, "NAME=ext/big", "KIND=torch", "SEED=9", "SIZE=" + strconv.Itoa(size),
		"PY_SCRIPT=" + script, "PYTHONPATH=" + pydir, "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"}
	exp := spawnIn(t, testutil.Container{Share: share, UID: exporterUID, GID: exporterUID}, "exec-python", env...)
	reg := strings.Fields(exp.expect("registered "))
	t.Logf("exporter: %v", reg)
	if len(reg) < 3 || reg[2] != "size="+strconv.Itoa(size) {
		t.Fatalf("exporter registered %v, want %d bytes", reg, size)
	}
	if n, _ := strconv.Atoi(strings.TrimPrefix(reg[1], "pieces=")); n <= protocol.MaxFiles {
		t.Fatalf("a %d-byte tensor registered as %s: want more pieces than one packet carries", size, reg[1])
	}
	renv := []string{"CUDAIPC_SOCKET=" + sock, fmt.Sprintf("NAME=%d:ext/big", exporterUID), "PY_SCRIPT=" + reader, "PYTHONPATH=" + pydir}
	rd := spawnIn(t, testutil.Container{Share: share, UID: nobodyUID, GID: nobodyUID}, "exec-python", renv...)
	want := reg[0] + " " + reg[0]
	if got := rd.expect("leased "); got != want+" share=vmm-fd external=True" {
		t.Fatalf("python reader: %s, want %s", got, want)
	}
	exp.kill9()
	<-exp.waited
	fmt.Fprintln(rd.in, "again")
	if got := rd.expect("again "); got != want {
		t.Fatalf("after the exporter was killed the reader reads %s, want %s", got, want)
	}
	fmt.Fprintln(rd.in, "release")
	rd.expect("released")
}
