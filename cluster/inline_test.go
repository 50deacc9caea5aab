package cluster

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"net"
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
	ctx, cc := dialServed(t, smallObject{oneObject{ref, id}, want})
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
	ctx, cc := dialServed(t, oneObject{ref, id})
	if _, err := cc.Read(ctx, ref, id, 10); !errors.Is(err, errNoInline) {
		t.Fatalf("read from a node without inline reads: %v", err)
	}
	if _, _, err := cc.Open(ctx, ref, id); err != nil {
		t.Fatalf("open after an unsupported read: %v", err)
	}
}

// A peer that sends inline bytes nobody asked for (a bug, or a peer out
// of step) breaks the channel: the request fails and the connection is
// closed, never read on from the middle of a frame.
func TestControlUnaskedInline(t *testing.T) {
	tr := transcript(make([]byte, 32), make([]byte, 32), "cli", "srv")
	c1, c2 := net.Pipe()
	defer c1.Close()
	srv := &channel{c: c1, peer: "cli", sendAEAD: testSecret.aead("s2c", tr), recv: testSecret.aead("c2s", tr)}
	cc := newControlClient(&channel{c: c2, peer: "srv", sendAEAD: testSecret.aead("c2s", tr), recv: testSecret.aead("s2c", tr)})
	go func() {
		var req ctlRequest
		if srv.read(&req) == nil {
			_ = srv.send(&ctlResponse{Tag: req.Tag, Handle: 1, Inline: 3, Exposure: Exposure{Worker: []byte("w"), RKey: []byte("k"), Addr: 1, Size: 3}}, []byte("abc"), time.Time{})
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := cc.Open(ctx, Ref{Owner: 1, Name: "x"}, NewID()); !errors.Is(err, ErrBadRecord) || !errors.Is(err, errChannel) {
		t.Fatalf("open answered with unasked inline bytes: %v", err)
	}
	if _, err := c2.Write([]byte{0}); err == nil {
		t.Fatal("the channel stayed open after an unasked inline answer")
	}
}
