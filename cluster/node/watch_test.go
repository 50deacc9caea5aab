package node_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/internal/testutil"
)

// pauseWatch holds d's watch until resume, or the test's end.
func pauseWatch(t *testing.T, d *daemon) (resume func()) {
	var once sync.Once
	r := node.PauseWatch(d.node)
	resume = func() { once.Do(r) }
	t.Cleanup(resume)
	return resume
}

// recordGone waits until ref's record is gone from etcd: the store tells
// the cluster of a delete after answering it, so a put of the same name
// just after its delete can still find the old record (and fail with
// cluster.ErrExists: put again).
func recordGone(t *testing.T, d *daemon, ref cluster.Ref) {
	t.Helper()
	testutil.Eventually(t, testutil.Wait, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if _, err := d.node.Directory().Lookup(ctx, ref); !errors.Is(err, cluster.ErrNotFound) {
			return fmt.Errorf("%s in the directory: %v", ref, err)
		}
		return nil
	})
}

// A node that deletes a plain name and creates it again before its own
// watch has seen the delete keeps the new object: the watch drops only the
// incarnation whose record went. Other nodes drop their replicas of the
// old one and then read the new one.
func TestRecreatedBeforeWatchSeesDelete(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	old := a.put(t, "ns/obj", 5000, client.CreateOptions{Cluster: true})
	if got, err := b.get(ctx, "ns/obj"); err != nil || !bytes.Equal(got, old) {
		t.Fatalf("B's first get: %v", err)
	}

	handled := node.WatchHandled(a.node)
	resume := pauseWatch(t, a)
	if err := a.c.Delete(ctx, "ns/obj"); err != nil {
		t.Fatal(err)
	}
	recordGone(t, a, cluster.Ref{Name: "ns/obj"})
	want := a.put(t, "ns/obj", 7000, client.CreateOptions{Cluster: true})
	resume()
	// The delete (one record) reaches A's watch after the new object is
	// published; the watch ignores the new object's put.
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := node.WatchHandled(a.node); n <= handled {
			return fmt.Errorf("A's watch handled %d events, want the delete's", n-handled)
		}
		return nil
	})
	if !a.st.Replicas().Has(0, "ns/obj", 0, 0) {
		t.Fatal("A dropped the object it created again when its watch saw the old one's delete")
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		got, err := b.get(ctx, "ns/obj")
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("B read %d bytes, not the new object's %d", len(got), len(want))
		}
		return nil
	})
}

// The same for a versioned name: deleted, and version 1 of it published
// again as the first of two shards (no latest yet, so the name reads as
// gone from the cluster) before the publisher's watch saw the delete. The
// pending shard stays; once the second is published, other nodes read
// the new version.
func TestRecreatedVersionBeforeWatchSeesDelete(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	ver, first := a.publish(t, "pol", 1, 3000)
	if v, got, err := b.getVersion(ctx, "pol", client.GetOptions{}); err != nil || v != ver || !bytes.Equal(got, first[0]) {
		t.Fatalf("B's first get: v%d %v", v, err)
	}

	handled := node.WatchHandled(a.node)
	resume := pauseWatch(t, a)
	if err := a.c.Delete(ctx, "pol"); err != nil {
		t.Fatal(err)
	}
	recordGone(t, a, cluster.Ref{Name: "pol", Version: ver})
	shards := make([][]byte, 2)
	put := func(shard int) {
		t.Helper()
		o, err := a.c.Publish(ctx, "pol", int64(4000+shard), client.CreateOptions{Cluster: true, Version: ver, Shards: 2, Shard: shard})
		if err != nil {
			t.Fatal(err)
		}
		for i := range o.Bytes() {
			o.Bytes()[i] = byte(i*7 + shard + 1)
		}
		shards[shard] = bytes.Clone(o.Bytes())
		if err := o.Seal(ctx); err != nil {
			t.Fatal(err)
		}
	}
	put(0)
	resume()
	testutil.Eventually(t, testutil.Wait, func() error {
		if n := node.WatchHandled(a.node); n <= handled {
			return fmt.Errorf("A's watch handled %d events, want the delete's", n-handled)
		}
		return nil
	})
	if !a.st.Replicas().Has(0, "pol", ver, 0) {
		t.Fatal("A dropped the shard it published again when its watch saw the old version's delete")
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		if b.st.Replicas().Has(0, "pol", ver, 0) {
			return fmt.Errorf("B still holds the deleted version")
		}
		return nil
	})
	put(1)
	for shard, want := range shards {
		testutil.Eventually(t, testutil.Wait, func() error {
			v, got, err := b.getVersion(ctx, "pol", client.GetOptions{Version: ver, Shard: shard})
			if err != nil {
				return err
			}
			if v != ver || !bytes.Equal(got, want) {
				return fmt.Errorf("B read v%d shard %d of %d bytes, not the new one", v, shard, len(got))
			}
			return nil
		})
	}
}

// A put right after a delete of the same name: the store tells the
// cluster of the delete after answering it, so the put can find the old
// incarnation still recorded with its own node as a holder. The put waits
// for that claim to go (held back here until the put is waiting), then
// publishes; other nodes then read the new object.
func TestPutRightAfterDelete(t *testing.T) {
	_, a, b, ctx := twoDaemons(t, 60*time.Second)
	old := a.put(t, "ns/again", 5000, client.CreateOptions{Cluster: true})
	if got, err := b.get(ctx, "ns/again"); err != nil || !bytes.Equal(got, old) {
		t.Fatalf("B's first get: %v", err)
	}
	release := node.HoldDeleted(t, a.node)
	waits := node.WithdrawWaits(a.node)
	if err := a.c.Delete(ctx, "ns/again"); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 7000)
	for i := range want {
		want[i] = byte(i * 13)
	}
	put := make(chan error, 1)
	go func() {
		o, err := a.c.Create(ctx, "ns/again", int64(len(want)), client.CreateOptions{Cluster: true})
		if err == nil {
			copy(o.Bytes(), want)
			err = o.Seal(ctx)
		}
		put <- err
	}()
	testutil.Eventually(t, testutil.Wait, func() error {
		select {
		case err := <-put:
			t.Fatalf("the put answered while the delete was held back: %v", err)
		default:
		}
		if node.WithdrawWaits(a.node) == waits {
			return fmt.Errorf("A's publish is not waiting for its old claim")
		}
		return nil
	})
	release()
	if err := <-put; err != nil {
		t.Fatalf("put right after the delete: %v", err)
	}
	testutil.Eventually(t, testutil.Wait, func() error {
		got, err := b.get(ctx, "ns/again")
		if err != nil {
			return err
		}
		if !bytes.Equal(got, want) {
			return fmt.Errorf("B read %d bytes, not the new object's %d", len(got), len(want))
		}
		return nil
	})
}
