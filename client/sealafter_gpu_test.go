package client_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/client"
)

// TestGPUSealAfterEvent: a producer copies random bytes into its object on a
// stream, signals an interprocess event and seals with SealAfter at once;
// a reader gets exactly those bytes, every time,
// for objects from 1 byte to 64 MiB. A plain event, a nil one and a second
// SealAfter are refused with ErrInvalid, and the object stays usable.
func TestGPUSealAfterEvent(t *testing.T) {
	d, dev := startGPUDaemon(t)
	c := dial(t, d.socket)
	ctx := context.Background()
	st, err := dev.NewStream()
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	ev, err := dev.NewIPCEvent()
	if err != nil {
		t.Fatal(err)
	}
	defer ev.Close()
	for i, size := range []int64{1, 4097, 1 << 20, 64 << 20} {
		name := fmt.Sprintf("after-%d", i)
		want := make([]byte, size)
		rand.Read(want)
		src, err := dev.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := src.WriteAt(want, 0); err != nil {
			t.Fatal(err)
		}
		o, err := c.Create(ctx, name, size, client.CreateOptions{Device: dev.UUID().String()})
		if err != nil {
			t.Fatal(err)
		}
		if err := st.CopyAsync(o.Ptr(), src.Ptr(), size); err != nil {
			t.Fatal(err)
		}
		if err := ev.Signal(st); err != nil {
			t.Fatal(err)
		}
		if err := o.SealAfter(ctx, ev); err != nil {
			t.Fatalf("%s: SealAfter: %v", name, err)
		}
		if o.Ptr() != 0 {
			t.Fatalf("%s: still mapped after SealAfter", name)
		}
		if err := o.SealAfter(ctx, ev); !errors.Is(err, client.ErrInvalid) {
			t.Fatalf("%s: second SealAfter: %v, want ErrInvalid", name, err)
		}
		if !bytes.Equal(getBytes(t, c, name, size), want) {
			t.Fatalf("%s: the sealed object does not hold the copied bytes", name)
		}
		src.Free()
	}

	// Refusals leave the object unsealed and writable.
	o, err := c.Create(ctx, "after-refused", 4096, client.CreateOptions{Device: dev.UUID().String()})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.SealAfter(ctx, nil); !errors.Is(err, client.ErrInvalid) {
		t.Fatalf("nil event: %v, want ErrInvalid", err)
	}
	plain, err := dev.NewEvent(0)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	if err := o.SealAfter(ctx, plain); !errors.Is(err, client.ErrInvalid) || !strings.Contains(err.Error(), "NewIPCEvent") {
		t.Fatalf("plain event: %v, want ErrInvalid naming NewIPCEvent", err)
	}
	want := make([]byte, 4096)
	rand.Read(want)
	if _, err := o.WriteAt(want, 0); err != nil {
		t.Fatalf("writing after the refusals: %v", err)
	}
	if err := o.Seal(ctx); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(getBytes(t, c, "after-refused", 4096), want) {
		t.Fatal("after the refusals: the object does not hold the bytes written")
	}
}
