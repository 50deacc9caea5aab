package ucxtransport_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/internal/clustertest"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/transport/ucx"
)

func TestMain(m *testing.M) {
	testutil.RunRole(roles)
	// UCX on loopback tcp only, its logs on stderr.
	testutil.SetUCXLoopbackEnv()
	os.Exit(m.Run())
}

func requireUCX(t *testing.T) {
	t.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" || os.Getenv(etcdtest.EnvRequire) == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// node is a clustertest.Transport on UCX: objects are registered one by
// one here; the daemon registers whole arenas.
type node struct{ *ucxtransport.Transport }

func (n node) Register(b []byte) ([]byte, uint64, func(), error) {
	r, err := n.Transport.Register(b)
	if err != nil {
		return nil, 0, nil, err
	}
	key, closeWindow, err := r.Window(0, int64(len(b)))
	if err != nil {
		r.Close()
		return nil, 0, nil, err
	}
	return key, r.Addr(0), func() { closeWindow(); r.Close() }, nil
}

func newNode(t *testing.T, name string) node { return newNodeWith(t, name, ucxtransport.Options{}) }

func newNodeWith(t *testing.T, name string, o ucxtransport.Options) node {
	t.Helper()
	tr, err := ucxtransport.NewWith(name, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return node{tr}
}

var secret, _ = cluster.NewSecret([]byte("ucx-transport-test-secret"))

// TestPullOverUCX: A reads with GETs, so it answers them too; B pulls from
// it with fetches (the default), C (reading with GETs) with GETs, and A
// from B, which answers no GETs, with fetches; every replica is right.
func TestPullOverUCX(t *testing.T) {
	requireUCX(t)
	srv := etcdtest.Start(t)
	getter := ucxtransport.Options{Read: ucxtransport.ReadGet}
	at, bt, ct := newNodeWith(t, "a", getter), newNode(t, "b"), newNodeWith(t, "c", getter)
	a := clustertest.StartNode(t, srv, at, "a", secret)
	b := clustertest.StartNode(t, srv, bt, "b", secret)
	c := clustertest.StartNode(t, srv, ct, "c", secret)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o, want := a.Put(t, "ns/ucx", 9<<20+4321, 1<<20)
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b.Store.Get(o.Ref()), want) {
		t.Fatal("B's replica differs")
	}
	if _, err := c.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(c.Store.Get(o.Ref()), want) {
		t.Fatal("C's replica differs")
	}
	if f, g := bt.Reads(); f == 0 || g != 0 {
		t.Errorf("B read with %d fetches and %d GETs; want fetches only", f, g)
	}
	// C reads from A and B, which both hold the object now: with GETs
	// from A, with fetches from B.
	if f, g := ct.Reads(); g == 0 {
		t.Errorf("C (ReadGet) read with %d fetches and %d GETs; want GETs from A", f, g)
	}
	o2, want2 := b.Put(t, "ns/ucx-back", 3<<20+5, 1<<20)
	if _, err := a.P.Pull(ctx, o2.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Store.Get(o2.Ref()), want2) {
		t.Fatal("A's replica differs")
	}
	if f, g := at.Reads(); f == 0 || g != 0 {
		t.Errorf("A (ReadGet) read from B, which answers no GETs, with %d fetches and %d GETs; want fetches only", f, g)
	}
	if _, err := ucxtransport.NewWith("bad", ucxtransport.Options{Read: "telepathy"}); err == nil {
		t.Error("an unknown read mode was accepted")
	}
	// A pull releases its exposures after it answers (in the background).
	testutil.Eventually(t, 10*time.Second, func() error {
		if n := a.Store.Exposed() + b.Store.Exposed(); n != 0 {
			return fmt.Errorf("%d exposures left after the pulls", n)
		}
		return nil
	})
}

func TestMalformedPeerData(t *testing.T) {
	requireUCX(t)
	a, b := newNode(t, "a"), newNode(t, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	for _, addr := range [][]byte{nil, []byte("x"), bytes.Repeat([]byte{0xff}, 100), a.WorkerAddress()[:len(a.WorkerAddress())/2]} {
		if _, err := b.Connect(ctx, addr); !errors.Is(err, ucx.ErrMalformed) {
			t.Errorf("connect to %d bytes of garbage: %v, want ErrMalformed", len(addr), err)
		}
	}
	buf := make([]byte, 1<<20)
	r, err := a.Transport.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ep, err := b.Connect(ctx, a.WorkerAddress())
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	key, closeWindow, err := r.Window(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer closeWindow()
	flipped := append([]byte(nil), key...)
	flipped[len(flipped)/2] ^= 1
	dst := make([]byte, 4096)
	for _, k := range [][]byte{nil, []byte("junk"), flipped, key[:len(key)-3]} {
		if err := ep.Get(ctx, k, r.Addr(0), dst); !errors.Is(err, ucx.ErrMalformed) {
			t.Errorf("get with a bad rkey of %d bytes: %v, want ErrMalformed", len(k), err)
		}
	}
	if err := ep.Get(ctx, key, r.Addr(1<<20-100), dst); !errors.Is(err, ucx.ErrOutOfBounds) {
		t.Errorf("get past the region: %v", err)
	}
	gone, err := a.Transport.Register(make([]byte, 1<<20))
	if err != nil {
		t.Fatal(err)
	}
	goneKey, _, err := gone.Window(0, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	gone.Close()
	if err := ep.Get(ctx, goneKey, gone.Addr(0), dst); !errors.Is(err, ucx.ErrRefused) {
		t.Errorf("get of a region the holder closed: %v, want ErrRefused", err)
	}
	if err := ep.Get(ctx, r.Key(), r.Addr(0), dst); !errors.Is(err, ucx.ErrNoRMA) {
		t.Errorf("get with a region key (no window) from a node that reads with fetches: %v, want ErrNoRMA", err)
	}
	small, closeSmall, err := r.Window(4096, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if err := ep.Get(ctx, small, r.Addr(8192), dst[:10]); !errors.Is(err, ucx.ErrRefused) {
		t.Errorf("get past a window: %v, want ErrRefused", err)
	}
	closeSmall()
	copy(buf[8192:], "through the registered arena")
	if err := ep.Get(ctx, key, r.Addr(8192), dst[:28]); err != nil || !strings.HasPrefix(string(dst), "through the registered arena") {
		t.Fatalf("get: %v %q", err, dst[:28])
	}
}

// TestPullOverUCXLanes: nodes of three, two and one lanes pull from each
// other (a pull uses as many lanes as both sides have, each read by a loop
// of its own): the bytes are right every way, and a node of one lane
// still reads from one of several.
func TestPullOverUCXLanes(t *testing.T) {
	requireUCX(t)
	srv := etcdtest.Start(t)
	lanes := func(name string, n int) node {
		tr, err := ucxtransport.NewWith(name, ucxtransport.Options{Lanes: n})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tr.Close() })
		return node{tr}
	}
	a := clustertest.StartNode(t, srv, lanes("a", 3), "a", secret)
	b := clustertest.StartNode(t, srv, lanes("b", 2), "b", secret)
	c := clustertest.StartNode(t, srv, lanes("c", 1), "c", secret)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	o, want := a.Put(t, "ns/lanes", 21<<20+77, 1<<20)
	if _, err := b.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(b.Store.Get(o.Ref()), want) {
		t.Fatal("B's replica (3 lanes to 2) differs")
	}
	if _, err := c.P.Pull(ctx, o.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(c.Store.Get(o.Ref()), want) {
		t.Fatal("C's replica (from 3 and 2 lanes, over 1) differs")
	}
	o2, want2 := c.Put(t, "ns/lanes-back", 9<<20, 1<<20)
	if _, err := a.P.Pull(ctx, o2.Ref()); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.Store.Get(o2.Ref()), want2) {
		t.Fatal("A's replica (1 lane to 3) differs")
	}
}

// TestFillingWindowOverLanes: B reads, over three lanes, a window of A's
// that A fills a slice at a time after handing out its key: B's reads of
// bytes not ready yet wait at A (counted Deferred) and end with the bytes
// written before each slice was said ready.
func TestFillingWindowOverLanes(t *testing.T) {
	requireUCX(t)
	a := newNodeWith(t, "a", ucxtransport.Options{Lanes: 3})
	b := newNodeWith(t, "b", ucxtransport.Options{Lanes: 3})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const size, slice = 12 << 20, 1 << 20
	buf := make([]byte, size)
	want := testutil.RandomBytes(1919, size)
	r, err := a.Transport.Register(buf)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fw, err := r.FillingWindow(0, size)
	if err != nil {
		t.Fatal(err)
	}
	defer fw.Close()
	key := fw.Key
	ep, err := b.Connect(ctx, a.WorkerAddress())
	if err != nil {
		t.Fatal(err)
	}
	defer ep.Close()
	errs := make(chan error, size/(2<<20))
	dst := make([]byte, size)
	for off := 0; off < size; off += 2 << 20 { // one read per 2 MiB, in flight at once
		go func() { errs <- ep.Get(ctx, key, r.Addr(int64(off)), dst[off:off+2<<20]) }()
	}
	time.Sleep(20 * time.Millisecond)
	for off := 0; off < size; off += slice {
		copy(buf[off:off+slice], want[off:off+slice])
		fw.Ready(int64(off + slice))
		time.Sleep(2 * time.Millisecond)
	}
	for range size / (2 << 20) {
		if err := testutil.Next(t, errs, 20*time.Second); err != nil {
			t.Fatal(err)
		}
	}
	if !bytes.Equal(dst, want) {
		t.Fatal("the bytes read through the filling window differ from those written")
	}
	if s := a.Served(); s.Deferred == 0 || s.Sent < size/(2<<20) {
		t.Fatalf("A's answers: %+v; want reads that waited", s)
	}
}
