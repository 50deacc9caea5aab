package cluster

import (
	"context"
	"errors"
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// checkedObject is oneObject that can say it holds its replica without
// exposing it (ReplicaChecker), and counts its exposures.
type checkedObject struct {
	oneObject
	exposed *atomic.Int32
}

func (s checkedObject) Expose(ref Ref, id string) (Exposure, func(), error) {
	s.exposed.Add(1)
	return s.oneObject.Expose(ref, id)
}

func (s checkedObject) HoldsReplica(ref Ref, id string) error {
	if ref != s.ref || id != s.id {
		return ErrNotFound
	}
	return nil
}

// A "have" whose feeder has finished is answered from ReplicaChecker, where
// the Source has it, without an exposure (which for a GPU replica would
// stage it to host memory): complete for the replica held, refused for
// another incarnation.
func TestHaveAsksReplicaChecker(t *testing.T) {
	src := checkedObject{oneObject{Ref{Owner: 1, Name: "x"}, "id1"}, new(atomic.Int32)}
	ctx, cc := dialServed(t, src)
	if _, _, complete, err := cc.Have(ctx, src.ref, "id1", 0); err != nil || !complete {
		t.Fatalf("have of the sealed replica: complete=%v, %v", complete, err)
	}
	if _, _, _, err := cc.Have(ctx, src.ref, "id2", 0); !errors.Is(err, ErrFeedGone) {
		t.Fatalf("have of another incarnation: %v, want ErrFeedGone", err)
	}
	if n := src.exposed.Load(); n != 0 {
		t.Fatalf("%d exposures to answer have: want none", n)
	}
	// Without the checker, the Source is asked to expose (and releases).
	ctx, cc = dialServed(t, src.oneObject)
	if _, _, complete, err := cc.Have(ctx, src.ref, "id1", 0); err != nil || !complete {
		t.Fatalf("have of the sealed replica, plain Source: complete=%v, %v", complete, err)
	}
}

// endedReplica is a replica being pulled whose pull has just ended: it
// refuses exposures as an ended replica's ReplicaTraits.Expose does.
type endedReplica struct{}

func (endedReplica) Bytes() []byte { return nil }
func (endedReplica) Seal() error   { return nil }
func (endedReplica) Abort()        {}
func (r endedReplica) Traits() ReplicaTraits {
	return ReplicaTraits{Expose: r.Expose}
}
func (endedReplica) Expose() (Exposure, func(), error) {
	return Exposure{}, nil, ErrNotFound
}

// A "feed" that finds the feed of a pull that has just ended (sealed, its
// feed not withdrawn yet) is answered from the Source: the sealed replica,
// complete, rather than a refusal that would send the reader to the
// holders.
func TestFeedOfAPullJustEnded(t *testing.T) {
	src := oneObject{Ref{Owner: 1, Name: "x"}, "id1"}
	feeding := &Feeding{}
	feeding.start(src.ref, src.id, endedReplica{}.Traits().Expose, 4)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cs := &ControlServer{Node: "srv", Secret: testSecret, Source: src, Feeding: feeding}
	done := make(chan struct{})
	go func() { cs.Serve(ln); close(done) }()
	defer func() { ln.Close(); <-done }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cc, err := DialControl(ctx, testSecret, "cli", "srv", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	e, _, have, complete, err := cc.Feed(ctx, src.ref, src.id)
	if err != nil || !complete || have != nil || e.Size != 10 {
		t.Fatalf("feed of a pull just ended: %+v complete=%v have=%v, %v; want the sealed replica, complete", e, complete, have, err)
	}
	// Another incarnation is refused, as not held.
	if _, _, _, _, err := cc.Feed(ctx, src.ref, "id2"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("feed of another incarnation: %v, want ErrNotFound", err)
	}
}
