package store

import (
	"fmt"
	"slices"
)

// DefaultKeepVersions is how many of a versioned name's latest visible
// versions the store keeps without leases, unless the name or
// Config.KeepVersions says otherwise.
const DefaultKeepVersions = 1

// MaxShards bounds the shards of one version.
const MaxShards = 1024

// series is a versioned name: its versions, pending and visible.
//
// A version is pending until all of its shards are sealed, then visible
// (atomically: readers see all of its shards or none). The latest visible
// version is what a get without a version returns. Visible versions beyond
// the keep newest are retired: no new lease by "latest", and their memory
// goes once no shard of them is leased. A lease on any shard pins the whole
// version, so a reader that got shard 0 of version v can always get the
// other shards of v.
type series struct {
	name     string
	owner    uint32
	shared   bool
	keep     int // 0: the store's default
	versions map[uint64]*version
	latest   uint64 // latest visible version; 0 when none yet
	last     uint64 // highest version number ever opened
	// floor: versions up to it are out of the cluster's keep_last window
	// (Replicas.Retire), retired as soon as they are published.
	floor uint64
	// spare holds, per shard index, the memory of a reclaimed version,
	// kept for the next version's shard of the same size: double
	// buffering. Readers that cached the arena's mapping then map
	// nothing new (a new GPU allocation costs every reader an import,
	// milliseconds across GPUs).
	spare map[int]*object
}

// version is one version of a series.
type version struct {
	s      *series
	n      uint64
	shards []*object // nil until created
	sealed int
	// state is where v is in its life (state.go): only v.to changes it.
	state    verState
	leases   int           // over all shards
	released chan struct{} // closed when leases drop to 0; made by a withdraw that waits
}

// keepLocked is how many visible versions of sr are kept without leases.
func (s *Store) keepLocked(sr *series) int {
	if sr.keep > 0 {
		return sr.keep
	}
	return s.cfg.KeepVersions
}

// versionForCreateLocked finds or opens the version a versioned create
// puts a shard in.
// A new name is claimed for a new series; a name that holds another kind
// is ErrExists.
func (ss *session) versionForCreateLocked(opt createReq, shards uint32) (v *version, newSeries bool, err error) {
	s := ss.s
	name := opt.name
	var sr *series
	if e := s.lookupLocked(name); e.is(kindSeries) {
		sr = e.ser
	} else {
		sr = &series{name: name, owner: ss.peer.uid, shared: opt.shared, versions: make(map[uint64]*version)}
		if err := s.claimLocked(name, sr.entry()); err != nil {
			return nil, false, fmt.Errorf("%w (and is not versioned)", err)
		}
		newSeries = true
	}
	v, err = ss.openForCreateLocked(sr, opt, shards)
	if err != nil && newSeries {
		s.unclaimLocked(name, sr.entry())
	}
	return v, newSeries, err
}

// openForCreateLocked finds or opens the version of sr a create of a shard
// goes in.
func (ss *session) openForCreateLocked(sr *series, opt createReq, shards uint32) (*version, error) {
	name := sr.name
	if sr.owner != ss.peer.uid && ss.peer.uid != 0 {
		return nil, fmt.Errorf("versioned object %q belongs to uid %d: %w", name, sr.owner, ErrPermission)
	}
	if opt.keep > 0 {
		sr.keep = int(opt.keep)
	}
	if opt.version != 0 {
		if v := sr.versions[opt.version]; v != nil {
			switch {
			case v.visible():
				return nil, fmt.Errorf("version %d of %q is already published: %w", opt.version, name, ErrExists)
			case len(v.shards) != int(shards):
				return nil, invalidf("version %d of %q has %d shards, not %d", opt.version, name, len(v.shards), shards)
			case v.shards[opt.shard] != nil:
				return nil, fmt.Errorf("shard %d of version %d of %q: %w", opt.shard, opt.version, name, ErrExists)
			}
			return v, nil
		}
		if opt.version <= sr.latest {
			return nil, fmt.Errorf("version %d of %q is not above the latest, %d: %w", opt.version, name, sr.latest, ErrExists)
		}
		return sr.openLocked(opt.version, shards), nil
	}
	// The oldest pending version still missing this shard: N ranks that
	// each create "the next version" meet in the same one.
	var pick *version
	for _, v := range sr.versions {
		if !v.visible() && len(v.shards) == int(shards) && v.shards[opt.shard] == nil && (pick == nil || v.n < pick.n) {
			pick = v
		}
	}
	if pick != nil {
		return pick, nil
	}
	return sr.openLocked(max(sr.last, sr.latest)+1, shards), nil
}

func (sr *series) openLocked(n uint64, shards uint32) *version {
	v := &version{s: sr, n: n, shards: make([]*object, shards)}
	sr.versions[n] = v
	sr.last = max(sr.last, n)
	return v
}

// unopenLocked gives back the number n of a version aborted before any
// reader could see it (its cluster publish failed), when it is the highest
// opened: a get of n then answers as before the put, and the same put may
// come again.
func (sr *series) unopenLocked(n uint64) {
	if sr.last != n {
		return
	}
	sr.last = sr.latest
	for m := range sr.versions {
		sr.last = max(sr.last, m)
	}
}

// dropEmptyVersionLocked forgets a version no shard was created in, after
// a failed create, and its series too when that create made it.
func (s *Store) dropEmptyVersionLocked(v *version, newSeries bool) {
	if v == nil || slices.ContainsFunc(v.shards, func(o *object) bool { return o != nil }) {
		return
	}
	delete(v.s.versions, v.n)
	if newSeries {
		s.unclaimLocked(v.s.name, v.s.entry())
	}
}

// readableBy reports whether a peer of uid may read sr's versions.
func (sr *series) readableBy(uid uint32) bool { return sr.shared || sr.owner == uid || uid == 0 }

// readyLocked reports whether v may be published here: every shard is
// sealed, and every cluster-visible one is published in the cluster
// directory, so that no node shows a version the cluster does not know
// (a failed cluster publish aborts the version instead: clusterSealed).
func (v *version) readyLocked() bool {
	if v.sealed != len(v.shards) {
		return false
	}
	for _, o := range v.shards {
		if o.cluster != nil && o.cluster.id == "" {
			return false
		}
	}
	return true
}

// retireLocked retires the visible versions of sr beyond its keep newest,
// freeing those without leases.
func (s *Store) retireLocked(sr *series) {
	var visible []*version
	for _, v := range sr.versions {
		if v.visible() && !v.retired() {
			visible = append(visible, v)
		}
	}
	keep := s.keepLocked(sr)
	if len(visible) <= keep {
		return
	}
	slices.SortFunc(visible, func(a, b *version) int {
		if a.n > b.n {
			return -1
		}
		return 1
	})
	for _, v := range visible[keep:] {
		s.retireVersionLocked(v)
	}
}

// versionShardLocked finds the shard of the version sel names of sr for a
// get: ErrTimeout while that version is not (yet) visible to this session.
func (ss *session) versionShardLocked(sr *series, sel versionSel) (*object, error) {
	name := sr.name
	if !sr.readableBy(ss.peer.uid) {
		return nil, fmt.Errorf("no version of %q yet: %w", name, ErrTimeout)
	}
	var v *version
	switch {
	case sel.version != 0:
		v = sr.versions[sel.version]
		if v != nil && v.withdrawn() {
			return nil, fmt.Errorf("version %d of %q was withdrawn by its publisher (latest is %d): %w", sel.version, name, sr.latest, ErrNotFound)
		}
		if v == nil || !v.visible() {
			// Gone for good: opened (or superseded) and no longer here.
			if v == nil && sel.version <= max(sr.latest, sr.last) {
				return nil, fmt.Errorf("version %d of %q was reclaimed or aborted (latest is %d): %w", sel.version, name, sr.latest, ErrNotFound)
			}
			return nil, fmt.Errorf("version %d of %q is not published yet: %w", sel.version, name, ErrTimeout)
		}
	case sr.latest > sel.newerThan && sr.versions[sr.latest] != nil && !sr.versions[sr.latest].withdrawn():
		v = sr.versions[sr.latest]
	case sr.latest > sel.newerThan:
		return nil, fmt.Errorf("version %d of %q was withdrawn by its publisher; none newer yet: %w", sr.latest, name, ErrTimeout)
	default:
		return nil, fmt.Errorf("no version of %q above %d yet: %w", name, sel.newerThan, ErrTimeout)
	}
	if v == nil {
		return nil, fmt.Errorf("version %d of %q: %w", sr.latest, name, ErrNotFound)
	}
	if int(sel.shard) >= len(v.shards) {
		return nil, invalidf("version %d of %q has %d shards, not shard %d", v.n, name, len(v.shards), sel.shard)
	}
	return v.shards[sel.shard], nil
}

// seriesInfoLocked describes a series by the shard 0 of its latest visible
// version, for list and stat; ok is false when none is visible.
func (ss *session) seriesInfoLocked(sr *series) (info, bool) {
	if sr.latest == 0 || !sr.readableBy(ss.peer.uid) {
		return info{}, false
	}
	v := sr.versions[sr.latest]
	if v == nil || v.withdrawn() || v.shards[0] == nil {
		return info{}, false
	}
	return v.shards[0].info(), true
}

// deleteSeriesLocked removes a versioned name: pending versions are
// aborted, visible ones freed now or with their last lease.
func (ss *session) deleteSeriesLocked(sr *series) {
	s := ss.s
	s.clusterSeriesDeletedLocked(sr)
	s.unclaimLocked(sr.name, sr.entry())
	for i, o := range sr.spare {
		s.freeLocked(o)
		delete(sr.spare, i)
	}
	var latest *object
	if v := sr.versions[sr.latest]; v != nil {
		latest = v.shards[0]
	}
	if latest != nil {
		s.emitObjectLocked(eventDeleted, latest)
	}
	for _, v := range sr.versions {
		if !v.visible() {
			s.abortVersionLocked(v)
		} else if !v.retired() {
			s.retireVersionLocked(v)
		}
	}
	s.log.Debug("versioned object deleted", "session", ss.id, "name", sr.name)
}

// event is what subscribers are told when kind happens to o.
func (o *object) event(kind eventKind) event {
	e := event{kind: kind, name: o.name}
	if o.ver != nil {
		e.version = o.ver.n
	}
	return e
}

// takeSpareLocked returns the spare memory of shard of v's series when it
// fits o (same size, device and pool), removing it from the series.
func (s *Store) takeSpareLocked(v *version, shard int, o *object) *object {
	if v == nil {
		return nil
	}
	sp := v.s.spare[shard]
	if sp == nil || sp.size != o.size || sp.dev != o.dev || sp.owner != o.owner || sp.shared != o.shared {
		return nil
	}
	delete(v.s.spare, shard)
	return sp
}

// freeSparesLocked frees every series' spare memory on device d, to make
// room; it reports whether it freed any.
func (s *Store) freeSparesLocked(d *device) bool {
	freed := false
	for _, e := range s.names {
		if !e.is(kindSeries) {
			continue
		}
		sr := e.ser
		for i, o := range sr.spare {
			if o.dev == d {
				s.freeLocked(o)
				delete(sr.spare, i)
				freed = true
			}
		}
	}
	return freed
}
