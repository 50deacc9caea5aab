package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"
)

// readDuringPublish is a ClusterHook whose Sealed, like the cluster node's,
// makes the incarnation visible before it returns: a reader asks the
// holder for it (LeaseCluster with its id) while the publish still runs.
type readDuringPublish struct {
	nopCluster
	id   string
	s    *Store
	read chan error // the reader's answer
}

func (h *readDuringPublish) Sealed(_ context.Context, co ClusterObject) (string, error) {
	go func() {
		f, err := h.s.Replicas().Lease(co.Owner, co.Name, co.Version, co.Shard, h.id)
		if err == nil {
			f.Release()
		}
		h.read <- err
	}()
	// The reader must not be refused while the publish is under way.
	select {
	case err := <-h.read:
		h.read <- err
		return "", fmt.Errorf("%w: %v", errReadDuringPublish, err)
	case <-time.After(200 * time.Millisecond):
	}
	return h.id, nil
}

var errReadDuringPublish = errors.New("the reader was answered before the publish ended")

// A holder asked for an incarnation whose publish is still running (the
// directory shows it a moment before the store knows its id) serves it once
// the publish ends, instead of refusing it as not found.
func TestLeaseClusterWaitsForPublish(t *testing.T) {
	h := &readDuringPublish{id: "id-9", read: make(chan error, 1)}
	s := newTestStore(t, Config{Capacity: 1 << 24, Cluster: h})
	h.s = s
	c := connect(t, s, 1000)
	p, _, err := c.ss.create(createReq{name: "1000:w", size: 8192, cluster: true})
	if err != nil {
		t.Fatal(err)
	}
	data := randomBytes(8192)
	copy(c.mapping(p), data)
	if err := c.ss.sealName("1000:w"); err != nil {
		t.Fatal(err)
	}
	if err := c.ss.clusterSealed(context.Background(), "1000:w", 0, 0); err != nil {
		t.Fatalf("publish: %v", err)
	}
	select {
	case err := <-h.read:
		if err != nil {
			t.Fatalf("holder's read of the incarnation being published: %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the holder's read never ended")
	}
	f, err := s.Replicas().Lease(1000, "w", 0, 0, h.id)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Release()
	got := make([]byte, f.Size)
	if _, err := f.File.ReadAt(got, f.Offset); err != nil {
		t.Fatal(err)
	}
	f.File.Close()
	if !bytes.Equal(got, data) {
		t.Fatal("the published object's bytes differ")
	}
}
