package cluster

import (
	"errors"
	"sync/atomic"
	"testing"
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
