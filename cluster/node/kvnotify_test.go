package node_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster/internal/etcdtest"
	"github.com/cudaipc/cudaipc/kv"
)

// TestKVNotifyAcrossNodes: a read with Notify of a space on another node
// tells the space's engine, through both daemons, when it ends, completed
// or failed (the reader's payload, its uid, pid 0); a notice for a space the
// node no longer has, or of the reader's own node, is refused with the
// protocol's codes, and both daemons serve on.
func TestKVNotifyAcrossNodes(t *testing.T) {
	srv := etcdtest.Start(t)
	a := startDaemon(t, srv, "a")
	b := startDaemon(t, srv, "b")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	l, sizes := kvLayout("vllm", 4, 16, 4096)
	src := newHostSpace(t, l, sizes, 7)
	sp, err := kv.Register(ctx, a.c, "notify/src", src.local, client.RegisterOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dst := registerDst(t, b, "notify/dst", "vllm", 4, 16, 4096)
	wait := func() []kv.Notice {
		wctx, wcancel := context.WithTimeout(ctx, 10*time.Second)
		defer wcancel()
		n, err := sp.WaitNotices(wctx)
		if err != nil {
			t.Fatalf("waiting for a notice from the other node: %v", err)
		}
		return n
	}
	ids := []int{5, 2, 9}
	tr, err := kv.ReadBlocks(ctx, b.c, kv.Request{Src: sp.Desc(), SrcBlocks: ids, Dst: dst.local, DstBlocks: ids, Notify: []byte("req-1")})
	if err != nil {
		t.Fatal(err)
	}
	if err := tr.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	checkRead(t, src, dst, make2(dst), ids, ids, 0, 4)
	if n := wait(); len(n) != 1 || string(n[0].Payload) != "req-1" || n[0].Failed || n[0].PID != 0 {
		t.Fatalf("notices after a read across nodes: %+v, want one of req-1, completed, pid 0", n)
	}

	// A failed read says so: a region of the source deleted.
	if err := a.c.Delete(ctx, "notify/src/2"); err != nil {
		t.Fatal(err)
	}
	tr, err = kv.ReadBlocks(ctx, b.c, kv.Request{Src: sp.Desc(), SrcBlocks: ids, Dst: dst.local, DstBlocks: ids, Notify: []byte("req-2")})
	if err != nil {
		t.Fatal(err)
	}
	var be *kv.BlockError
	if err := tr.Wait(ctx); !errors.As(err, &be) {
		t.Fatalf("a read of a space missing a region: %v, want a BlockError", err)
	}
	if n := wait(); len(n) != 1 || string(n[0].Payload) != "req-2" || !n[0].Failed {
		t.Fatalf("notices after a failed read across nodes: %+v, want one of req-2, failed", n)
	}

	// Refusals: a space of the reader's own node, a payload past the
	// bound, a space gone.
	srcText, err := sp.Desc().MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if err := a.c.NotifySpace(ctx, srcText, []byte{0}); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("kv_notify of a space of the daemon's own node: %v, want ErrInvalid", err)
	}
	if err := b.c.NotifySpace(ctx, srcText, make([]byte, 4097)); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("kv_notify of 4097 bytes: %v, want ErrInvalid", err)
	}
	if err := sp.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if err := b.c.NotifySpace(ctx, srcText, []byte{0}); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("kv_notify of a space closed: %v, want ErrNotFound", err)
	}
	if _, err := a.c.List(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.List(ctx); err != nil {
		t.Fatal(err)
	}
}
