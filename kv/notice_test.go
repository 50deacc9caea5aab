package kv_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/testutil"
	"github.com/cudaipc/cudaipc/kv"
)

// TestReadNotifiesSource: a read with Notify tells the source's engine
// when it ends, completed or failed, with the reader's payload and pid
// (vLLM's get_finished); notices of another form are dropped by kv; a
// notice to what is not registered memory, or whose exporter ended, is
// ErrNotFound, and a payload past the bound is refused before it is sent.
func TestReadNotifiesSource(t *testing.T) {
	sock := startDaemon(t)
	ctx := context.Background()
	c := dial(t, sock)
	sp := poolSpace(t, c, "notice/kv", "vllm", 2, 8, 64, 21)
	text, err := sp.Desc().MarshalText()
	if err != nil {
		t.Fatal(err)
	}
	read := func(payload string) (readerMsg, int) {
		rd := testutil.SpawnWith(t, "reader", testutil.SpawnOptions{Env: []string{"SOCK=" + sock, "DESC=" + string(text), "NOTIFY=" + payload}})
		var m readerMsg
		if err := rd.Recv(&m); err != nil {
			t.Fatalf("reader: %v: %s", err, rd.Stderr())
		}
		return m, rd.Pid()
	}
	wait := func() []kv.Notice {
		wctx, cancel := context.WithTimeout(ctx, testutil.Wait)
		defer cancel()
		n, err := sp.WaitNotices(wctx)
		if err != nil {
			t.Fatalf("waiting for a notice: %v", err)
		}
		return n
	}

	m, pid := read("request-17")
	if m.Err != "" {
		t.Fatalf("read: %s", m.Err)
	}
	if n := wait(); len(n) != 1 || string(n[0].Payload) != "request-17" || n[0].Failed || n[0].PID != uint32(pid) {
		t.Fatalf("notices after a read by pid %d: %+v, want one of request-17, not failed", pid, n)
	}

	// A read that fails (a region of the space deleted) says so.
	if err := c.Delete(ctx, "notice/kv/1"); err != nil {
		t.Fatal(err)
	}
	if m, _ := read("request-18"); m.Err != "notfound" {
		t.Fatalf("read of a space missing a region: %+v, want notfound", m)
	}
	if n := wait(); len(n) != 1 || string(n[0].Payload) != "request-18" || !n[0].Failed {
		t.Fatalf("notices after a failed read: %+v, want one of request-18, failed", n)
	}

	// Anyone who can read the space can notify it: kv keeps only its form.
	other := dial(t, sock)
	region := sp.Desc().RegionName(0)
	for _, p := range [][]byte{nil, {9, 'x'}, {0, 'o', 'k'}} {
		if err := other.Notify(ctx, region, p); err != nil {
			t.Fatalf("notify %q: %v", p, err)
		}
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := sp.TakeNotices(); len(n) != 1 || string(n[0].Payload) != "ok" {
			return fmt.Errorf("notices of three payloads, one of kv's form: %+v", n)
		}
		return nil
	})
	if err := other.Notify(ctx, region, make([]byte, 4097)); !errors.Is(err, client.ErrInvalid) {
		t.Errorf("a notice of 4097 bytes: %v, want ErrInvalid", err)
	}
	if _, err := kv.ReadBlocks(ctx, other, kv.Request{Src: sp.Desc(), SrcBlocks: []int{0}, Dst: sp.Local(), DstBlocks: []int{1}, Notify: make([]byte, 4096)}); !errors.Is(err, kv.ErrInvalidRequest) {
		t.Errorf("a read with a notice of 4096 bytes: %v, want ErrInvalidRequest", err)
	}
	if err := other.Notify(ctx, "notice/none", []byte{0}); !errors.Is(err, client.ErrNotFound) {
		t.Errorf("a notice to an unknown name: %v, want ErrNotFound", err)
	}
	o, err := other.Create(ctx, "notice/plain", 64, client.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Notify(ctx, "notice/plain", []byte{0}); !errors.Is(err, client.ErrNotFound) || !strings.Contains(err.Error(), "registered") {
		t.Errorf("a notice to an object that is not registered memory: %v, want ErrNotFound", err)
	}
	// The exporter gone (its connection closed, a reader holding a lease
	// keeps the memory): nobody to tell.
	l, err := other.Get(ctx, region)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Release()
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	testutil.Eventually(t, 5*time.Second, func() error {
		err := other.Notify(ctx, region, []byte{0})
		if !errors.Is(err, client.ErrNotFound) {
			return fmt.Errorf("a notice to an orphan: %v, want ErrNotFound", err)
		}
		return nil
	})
}
