package node_test

import (
	"bytes"
	"context"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/cudaipc/cudaipc/client"
)

// putShard writes shard of version ver (of shards shards) of the
// cluster-visible name on d with random bytes of seed and seals it. It
// returns the bytes and the first error, of the create or the seal.
func (d *daemon) putShard(ctx context.Context, name string, ver uint64, shards, shard, size int, seed byte) ([]byte, error) {
	o, err := d.c.Publish(ctx, name, int64(size), client.CreateOptions{Cluster: true, Version: ver, Shards: shards, Shard: shard})
	if err != nil {
		return nil, err
	}
	b := make([]byte, size)
	rand.NewChaCha8([32]byte{seed, byte(shard), byte(ver)}).Read(b)
	copy(o.Bytes(), b)
	return b, o.Seal(ctx)
}

// errKind names the sentinel of a get's error, for comparing a get before
// and after a failed put.
func errKind(err error) string {
	for _, k := range []struct {
		name string
		err  error
	}{{"not found", client.ErrNotFound}, {"timeout", client.ErrTimeout}, {"unavailable", client.ErrUnavailable}} {
		if errors.Is(err, k.err) {
			return k.name
		}
	}
	if err == nil {
		return "none"
	}
	return "other: " + err.Error()
}

// A version whose cluster publish fails because etcd is away is not kept
// (docs/cluster.md, "etcd away"): its seal fails UNAVAILABLE, nothing of it
// is readable on its node (a get of it, or of the latest, answers as
// before the put), its number stays free, and the same put works once
// etcd is back and is read on another node. With two shards, the version
// is aborted as a whole when its second shard's publish fails: its first,
// published, shard goes too.
func TestVersionPublishWithoutEtcd(t *testing.T) {
	srv, a, b, ctx := twoDaemons(t, 120*time.Second)
	const size = 100001
	for _, shards := range []int{1, 2} {
		name := "verfail" + string(rune('0'+shards))
		v1, s1 := a.publish(t, name, shards, size)
		v2 := v1 + 1
		getV2 := func() error {
			_, _, err := a.getVersion(ctx, name, client.GetOptions{Version: v2})
			return err
		}
		if shards == 2 {
			// Shard 0 of v2 goes out while etcd is up; shard 1's publish fails.
			if _, err := a.putShard(ctx, name, v2, shards, 0, size, 7); err != nil {
				t.Fatalf("%s: shard 0 of v%d: %v", name, v2, err)
			}
		}
		srv.Kill()
		before := errKind(getV2())
		_, err := a.putShard(ctx, name, v2, shards, shards-1, size, 7)
		if !errors.Is(err, client.ErrUnavailable) || !strings.Contains(err.Error(), "not kept") {
			t.Fatalf("%s: last shard of v%d with etcd down: %v, want UNAVAILABLE and not kept", name, v2, err)
		}
		if after := errKind(getV2()); after != before {
			t.Fatalf("%s: get of v%d after the failed put: %s, before it: %s", name, v2, after, before)
		}
		for shard := range shards {
			if _, _, err := a.getVersion(ctx, name, client.GetOptions{Version: v2, Shard: shard}); err == nil {
				t.Fatalf("%s: shard %d of the unpublished v%d is readable", name, shard, v2)
			}
		}
		if ver, got, err := a.getVersion(ctx, name, client.GetOptions{}); err != nil || ver != v1 || !bytes.Equal(got, s1[0]) {
			t.Fatalf("%s: latest after the failed put: v%d %v, want v%d's bytes", name, ver, err, v1)
		}
		srv.Restart()
		// The same put of v2 goes out once etcd answers; its number was
		// never taken.
		var s2 [][]byte
		eventually(t, 30*time.Second, name+": the put of v2 works again", func() bool {
			got, err := a.putShard(ctx, name, v2, shards, 0, size, 9)
			if errors.Is(err, client.ErrExists) {
				t.Fatalf("%s: v%d again: %v", name, v2, err)
			}
			if err == nil {
				s2 = append(s2[:0], got)
			}
			return err == nil
		})
		for shard := 1; shard < shards; shard++ {
			got, err := a.putShard(ctx, name, v2, shards, shard, size, 9)
			if err != nil {
				t.Fatalf("%s: shard %d of v%d again: %v", name, shard, v2, err)
			}
			s2 = append(s2, got)
		}
		for shard := range shards {
			ver, got, err := b.getVersion(ctx, name, client.GetOptions{Version: v2, Shard: shard})
			if err != nil || ver != v2 || !bytes.Equal(got, s2[shard]) {
				t.Fatalf("%s: shard %d of v%d on B: v%d %v", name, shard, v2, ver, err)
			}
		}
		if ver, got, err := a.getVersion(ctx, name, client.GetOptions{}); err != nil || ver != v2 || !bytes.Equal(got, s2[0]) {
			t.Fatalf("%s: latest on A: v%d %v, want v%d's bytes", name, ver, err, v2)
		}
	}
}
