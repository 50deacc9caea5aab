package client_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

func TestShareBetweenProcesses(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	if got := c.Server().Backend; got != "host" {
		t.Errorf("backend %q, want host", got)
	}
	for _, size := range []int64{1, 4095, 4096, 1 << 20, 8<<20 + 3} {
		name := fmt.Sprintf("obj-%d", size)
		p := spawn(t, "producer", nil, "CUDAIPC_SOCKET="+d.socket, "NAME="+name, "SIZE="+strconv.FormatInt(size, 10))
		sum := p.expect("sealed ")
		l, err := c.Get(context.Background(), name)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(l.Bytes())) != size || hash(l.Bytes()) != sum {
			t.Errorf("%s: read %d bytes hashing %s, producer wrote %d hashing %s", name, len(l.Bytes()), hash(l.Bytes()), size, sum)
		}
		info := l.Info()
		if info.Name != name || info.Size != size || !info.Sealed || info.Device != "host" {
			t.Errorf("lease info %+v", info)
		}
		if err := l.Release(); err != nil {
			t.Fatal(err)
		}
		if err := l.Release(); err != nil {
			t.Errorf("second Release: %v", err)
		}
	}
}

func TestGetWaitsForSealWhileOtherCallsProceed(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan []byte, 1)
	go func() {
		l, err := c.GetWith(ctx, "later", client.GetOptions{Wait: true})
		if err != nil {
			t.Error(err)
			got <- nil
			return
		}
		got <- bytes.Clone(l.Bytes())
		l.Release()
	}()
	// The waiting Get does not block other calls on the same connection.
	want := put(t, c, "other", 12345)
	if _, err := c.Stat(ctx, "other"); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, events, testutil.Wait, func(ev client.Event) bool { return ev.Kind == client.EventSealed && ev.Name == "other" })
	w2 := dial(t, d.socket)
	want2 := put(t, w2, "later", 777)
	if b := <-got; !bytes.Equal(b, want2) {
		t.Errorf("waiting Get read %d bytes, not what was sealed", len(b))
	}
	checkGet(t, c, "other", want)
}

func TestGetDeadlineAndCancel(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	_, err := c.GetWith(ctx, "never", client.GetOptions{Wait: true})
	if !errors.Is(err, client.ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Get past deadline: %v; want ErrTimeout and DeadlineExceeded", err)
	}
	// Without Wait, a name nobody sealed fails at once, whatever the
	// context allows.
	if _, err := c.Get(context.Background(), "never"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Get of a name nobody sealed: %v; want ErrNotFound", err)
	}

	// A Get abandoned by its caller while it waits must not leave a lease
	// behind once the object is sealed.
	cctx, ccancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { _, err := c.GetWith(cctx, "abandoned", client.GetOptions{Wait: true}); done <- err }()
	other := dial(t, d.socket)
	o, err := other.Create(context.Background(), "abandoned", 100, client.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ccancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled Get: %v", err)
	}
	rand.NewChaCha8([32]byte{1}).Read(o.Bytes())
	if err := o.Seal(context.Background()); err != nil {
		t.Fatal(err)
	}
	// The daemon may have granted the abandoned get's lease; the client
	// releases it. Either way the count ends at 0.
	waitLeases(t, other, "abandoned", 0)
	// The connection is still fine.
	l, err := c.Get(context.Background(), "abandoned")
	if err != nil {
		t.Fatal(err)
	}
	l.Release()
}

func TestErrors(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	if _, err := c.Stat(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Stat missing: %v", err)
	}
	if err := c.Delete(ctx, "missing"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Delete missing: %v", err)
	}
	put(t, c, "x", 10)
	if _, err := c.Create(ctx, "x", 10, client.CreateOptions{}); !errors.Is(err, client.ErrExists) {
		t.Errorf("Create existing: %v", err)
	}
	for _, bad := range []string{"", "nl\nhere", "tab\there", string(make([]byte, 256))} {
		if _, err := c.Create(ctx, bad, 10, client.CreateOptions{}); !errors.Is(err, client.ErrInvalid) {
			t.Errorf("Create %q: %v", bad, err)
		}
	}
	if _, err := c.Create(ctx, "zero", 0, client.CreateOptions{}); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("Create size 0: %v", err)
	}
	_, err := client.Dial(ctx, filepath.Join(t.TempDir(), "nobody.sock"))
	if !errors.Is(err, client.ErrStoreGone) {
		t.Errorf("Dial without daemon: %v", err)
	}
}

func TestKillLeaseHolder(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	want := put(t, c, "held", 1<<20)
	h := spawn(t, "holder", nil, "CUDAIPC_SOCKET="+d.socket, "NAME=held")
	if got := h.expect("leased "); got != hash(want) {
		t.Fatalf("holder read hash %s, want %s", got, hash(want))
	}
	waitLeases(t, c, "held", 1)
	h.kill9()
	waitLeases(t, c, "held", 0)
	if err := c.Delete(context.Background(), "held"); err != nil {
		t.Fatal(err)
	}
}

func TestKillCreatorMidWrite(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cr := spawn(t, "creator", nil, "CUDAIPC_SOCKET="+d.socket, "NAME=half", "SIZE=2097152")
	cr.expect("writing")
	// Unsealed: invisible to others, and Get does not return it.
	short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	_, err = c.GetWith(short, "half", client.GetOptions{Wait: true})
	cancel()
	if !errors.Is(err, client.ErrTimeout) {
		t.Fatalf("Get of an unsealed object: %v, want ErrTimeout", err)
	}
	if _, err := c.Get(ctx, "half"); !errors.Is(err, client.ErrNotFound) {
		t.Fatalf("Get without Wait of an unsealed object: %v, want ErrNotFound", err)
	}
	cr.kill9()
	if ev := testutil.WaitFor(t, events, testutil.Wait, func(ev client.Event) bool { return ev.Name == "half" }); ev.Kind != client.EventAborted {
		t.Fatalf("event %+v, want aborted", ev)
	}
	if _, err := c.Stat(ctx, "half"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Stat after the creator died: %v", err)
	}
	// The name is free again.
	checkGet(t, c, "half", put(t, c, "half", 1<<20))
}

func TestUIDNotAllowed(t *testing.T) {
	if os.Getuid() != 0 {
		t.Skip("needs root to run a child as another uid (CI runs as root)")
	}
	// A world-traversable directory, so that the refusal comes from the
	// daemon's SO_PEERCRED check and not from file permissions.
	dir, err := os.MkdirTemp("", "cudaipc-uid-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "store.sock")
	d := startDaemon(t, sock, "ALLOW_UIDS=65534")
	// The go tool builds the test binary in a directory only root may
	// enter; the children run a copy.
	exe := filepath.Join(dir, "client.test")
	bin, err := os.ReadFile(os.Args[0])
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}

	allowed := spawnExe(t, exe, "dialer", &syscall.Credential{Uid: 65534, Gid: 65534}, "CUDAIPC_SOCKET="+sock, "NAME=from-nobody")
	if got := allowed.line(); got != "ok" {
		t.Errorf("allowed uid 65534: %s", got)
	}
	denied := spawnExe(t, exe, "dialer", &syscall.Credential{Uid: 65533, Gid: 65533}, "CUDAIPC_SOCKET="+sock, "NAME=from-other")
	if got := denied.expect("err "); got[:len("permission")] != "permission" {
		t.Errorf("uid 65533 not admitted: dial said %s, want permission", got)
	}
	// The admitted uid's object is private to it: root sees it, the
	// admitted uid made it.
	c := dial(t, d.socket)
	info, err := c.Stat(context.Background(), "65534:from-nobody")
	if err != nil {
		t.Fatal(err)
	}
	if info.OwnerUID != 65534 || info.Shared {
		t.Errorf("object of uid 65534: %+v", info)
	}
}

func TestManyConcurrentClients(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	const n = 64
	seed := rand.Uint64()
	name := func(i int) string { return "c" + strconv.Itoa(i) }
	size := func(i int) int { return 1000 + 997*i }
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := context.Background()
			c, err := client.Dial(ctx, d.socket)
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			o, err := c.Create(ctx, name(i), int64(size(i)), client.CreateOptions{})
			if err != nil {
				t.Error(err)
				return
			}
			copy(o.Bytes(), stream(seed, name(i), size(i)))
			if err := o.Seal(ctx); err != nil {
				t.Error(err)
				return
			}
			// Read everyone's object, waiting for those not sealed yet,
			// several Gets in flight on one connection at once.
			var rg sync.WaitGroup
			for j := range n {
				rg.Add(1)
				go func() {
					defer rg.Done()
					l, err := c.GetWith(ctx, name(j), client.GetOptions{Wait: true})
					if err != nil {
						t.Error(err)
						return
					}
					defer l.Release()
					if !bytes.Equal(l.Bytes(), stream(seed, name(j), size(j))) {
						t.Errorf("client %d read wrong bytes for %s", i, name(j))
					}
				}()
			}
			rg.Wait()
			// Keep the connection (and so the object) until all have read.
		}()
	}
	wg.Wait()
	c := dial(t, d.socket)
	objs, err := c.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(objs) != n {
		t.Errorf("List: %d objects, want %d", len(objs), n)
	}
	for _, o := range objs {
		if o.Leases != 0 {
			t.Errorf("%s still has %d leases", o.Name, o.Leases)
		}
	}
}

func TestDeleteWhileLeased(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c := dial(t, d.socket)
	ctx := context.Background()
	want, l := putLeased(t, c, "doomed", 3<<20)
	other := dial(t, d.socket)
	if err := other.Delete(ctx, "doomed"); err != nil {
		t.Fatal(err)
	}
	if _, err := other.Stat(ctx, "doomed"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("Stat after Delete: %v", err)
	}
	// The name is free at once; the new object must not reuse the leased
	// memory.
	want2 := put(t, other, "doomed", 3<<20)
	checkLeaseHeld(t, l, want, "its object was deleted and the name reused")
	checkGet(t, c, "doomed", want2)
}

func TestEvictionUnderPressure(t *testing.T) {
	const mib = 1 << 20
	d := startDaemon(t, socketPath(t), "CAPACITY="+strconv.Itoa(8*mib))
	c := dial(t, d.socket)
	ctx := context.Background()
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A leased object is never evicted.
	keep, l := putLeased(t, c, "keep", mib)
	// Far more than fits: older unleased objects make room for newer.
	for i := range 24 {
		put(t, c, "e"+strconv.Itoa(i), mib)
	}
	if !bytes.Equal(l.Bytes(), keep) {
		t.Fatal("a leased object's bytes changed under pressure")
	}
	if _, err := c.Stat(ctx, "keep"); err != nil {
		t.Errorf("leased object evicted: %v", err)
	}
	if _, err := c.Stat(ctx, "e0"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("oldest unleased object still there: %v", err)
	}
	if _, err := c.Stat(ctx, "e23"); err != nil {
		t.Errorf("newest object missing: %v", err)
	}
	// The oldest went first.
	if ev := testutil.WaitFor(t, events, testutil.Wait, func(ev client.Event) bool { return ev.Kind == client.EventEvicted }); ev.Name != "e0" {
		t.Errorf("first eviction %q, want e0", ev.Name)
	}
	// When everything is leased, nothing can be evicted: ErrStoreFull.
	objs, err := c.List(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range objs {
		if o.Name == "keep" {
			continue
		}
		ol, err := c.Get(ctx, o.Name)
		if err != nil {
			t.Fatal(err)
		}
		defer ol.Release()
	}
	if _, err := c.Create(ctx, "nope", 7*mib, client.CreateOptions{}); !errors.Is(err, client.ErrStoreFull) {
		t.Errorf("Create with everything leased: %v, want ErrStoreFull", err)
	}
}

func TestNoEvict(t *testing.T) {
	const mib = 1 << 20
	d := startDaemon(t, socketPath(t), "CAPACITY="+strconv.Itoa(4*mib), "NOEVICT=1")
	c := dial(t, d.socket)
	var err error
	for i := 0; err == nil && i < 10; i++ {
		var o *client.Object
		o, err = c.Create(context.Background(), "n"+strconv.Itoa(i), mib, client.CreateOptions{})
		if err == nil {
			err = o.Seal(context.Background())
		}
	}
	if !errors.Is(err, client.ErrStoreFull) {
		t.Errorf("10 MiB into 4 MiB without eviction: %v, want ErrStoreFull", err)
	}
	if _, err := c.Stat(context.Background(), "n0"); err != nil {
		t.Errorf("n0 evicted despite NoEvict: %v", err)
	}
}

func TestDaemonRestart(t *testing.T) {
	sock := socketPath(t)
	d := startDaemon(t, sock)
	c := dial(t, sock)
	ctx := context.Background()
	want, l := putLeased(t, c, "before", 5000)
	events, err := c.Subscribe(ctx)
	if err != nil {
		t.Fatal(err)
	}
	waiting := make(chan error, 1)
	go func() { _, err := c.GetWith(ctx, "never-sealed", client.GetOptions{Wait: true}); waiting <- err }()

	d.kill9() // leaves a stale socket behind
	if err := <-waiting; !errors.Is(err, client.ErrStoreGone) {
		t.Errorf("waiting Get when the daemon died: %v, want ErrStoreGone", err)
	}
	testutil.Drain(t, events, testutil.Wait) // closed when the connection is lost
	if _, err := c.Stat(ctx, "before"); !errors.Is(err, client.ErrStoreGone) {
		t.Errorf("Stat after the daemon died: %v, want ErrStoreGone", err)
	}
	// The lease's memory stays mapped until Release.
	checkLeaseHeld(t, l, want, "the daemon died")
	if _, err := client.Dial(ctx, sock); !errors.Is(err, client.ErrStoreGone) {
		t.Errorf("Dial with no daemon: %v, want ErrStoreGone", err)
	}

	startDaemon(t, sock) // replaces the stale socket
	c2 := dial(t, sock)
	if _, err := c2.Stat(ctx, "before"); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("new daemon knows an old object: %v", err)
	}
	checkGet(t, c2, "after", put(t, c2, "after", 5000))
}

func TestCloseWithLiveLease(t *testing.T) {
	d := startDaemon(t, socketPath(t))
	c, err := client.Dial(context.Background(), d.socket)
	if err != nil {
		t.Fatal(err)
	}
	want, l := putLeased(t, c, "kept", 9000)
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	// Still mapped: Close leaves memory in use alone.
	checkLeaseHeld(t, l, want, "Close")
	if _, err := c.Stat(context.Background(), "kept"); !errors.Is(err, client.ErrClosed) {
		t.Errorf("Stat after Close: %v, want ErrClosed", err)
	}
}
