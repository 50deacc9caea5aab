package cluster

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"testing"
	"time"
)

// smallObject serves one replica's bytes inline (a ReplicaReader).
type smallObject struct {
	oneObject
	b []byte
}

func (s smallObject) ReadReplica(ref Ref, id string, max int64) ([]byte, error) {
	if ref != s.ref || id != s.id {
		return nil, ErrNotFound
	}
	if int64(len(s.b)) > max {
		return nil, errors.New("too large")
	}
	return bytes.Clone(s.b), nil
}

func TestControlRead(t *testing.T) {
	ref := Ref{Owner: 1, Name: "x"}
	id := NewID()
	want := make([]byte, MaxInline)
	rand.NewChaCha8([32]byte{7}).Read(want)
	addr := serveControl(t, testSecret, smallObject{oneObject{ref, id}, want})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	for range 3 { // the channel stays in step after each
		got, err := cc.Read(ctx, ref, id, int64(len(want)))
		if err != nil || !bytes.Equal(got, want) {
			t.Fatalf("read: %d bytes, %v", len(got), err)
		}
		if _, _, err := cc.Open(ctx, ref, id); err != nil {
			t.Fatalf("open after a read: %v", err)
		}
	}
	if _, err := cc.Read(ctx, ref, NewID(), int64(len(want))); !errors.Is(err, ErrNotFound) {
		t.Fatalf("read of another incarnation: %v", err)
	}
	if _, err := cc.Read(ctx, ref, id, 10); err == nil {
		t.Fatal("a read of another size than the record's succeeded")
	}
	if _, _, err := cc.Open(ctx, ref, id); err != nil {
		t.Fatalf("open after failed reads: %v", err)
	}
}

// A node whose store cannot copy replicas answers "read" as an unknown
// op; the reader falls back to "open" on the same channel.
func TestControlReadUnsupported(t *testing.T) {
	ref := Ref{Owner: 1, Name: "x"}
	id := NewID()
	addr := serveControl(t, testSecret, oneObject{ref, id})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := DialControl(ctx, testSecret, "cli", "srv", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	if _, err := cc.Read(ctx, ref, id, 10); !errors.Is(err, errNoInline) {
		t.Fatalf("read from a node without inline reads: %v", err)
	}
	if _, _, err := cc.Open(ctx, ref, id); err != nil {
		t.Fatalf("open after an unsupported read: %v", err)
	}
}
