package cluster

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash/crc32"
	"math/bits"
	"net"
	"runtime"
	"strconv"
	"sync"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/cudaipc/cudaipc/protocol"
)

// Limits on what directory records may hold; a record beyond them is
// ErrBadRecord.
const (
	// MaxRecordLen bounds an encoded record: etcd's default request limit
	// is 1.5 MiB.
	MaxRecordLen = 1 << 20
	// MaxWorkerAddrLen bounds a UCX worker address (a few hundred bytes
	// over tcp; more with several RDMA devices).
	MaxWorkerAddrLen = 64 << 10
	// MaxNodeNameLen bounds a node name.
	MaxNodeNameLen = 63
	// MaxShards bounds the shards of one version (the store's limit).
	MaxShards = 1024
	// MinChunkSize and MaxChunkSize bound Object.ChunkSize, a power of
	// two.
	MinChunkSize = 64 << 10
	MaxChunkSize = 1 << 30
	// MaxChunks bounds the chunks of one object, so that its checksums fit
	// in one record: ChunkSizeFor grows the chunk for large objects.
	MaxChunks = 64 << 10
	// DefaultChunkSize is the chunk of objects small enough to need no
	// larger one: up to TargetChunks of it (4 GiB).
	DefaultChunkSize = 4 << 20
	// TargetChunks and LargeChunkSize: ChunkSizeFor doubles
	// DefaultChunkSize, up to LargeChunkSize, while an object has more
	// than TargetChunks chunks. A multi-GiB object (a model's weights) is
	// read in 16 MiB chunks, since over tcp each read costs a rendezvous;
	// objects up to 4 GiB keep the finer grain that partial reads, fan-out
	// and rereads of corrupt chunks gain from (docs/cluster.md, "Chunks").
	TargetChunks   = 1024
	LargeChunkSize = 16 << 20
	// MaxManifestLen bounds a bundle's manifest carried in its record:
	// with MaxChunks checksums (at most 11 bytes each in JSON) and the
	// manifest in base64, a record stays under MaxRecordLen.
	MaxManifestLen = 192 << 10
)

// recordMagic starts every encoded record, before its MAC.
var recordMagic = []byte("cr1")

const macLen = 32

// castagnoli is the CRC-32C table: chunk checksums are CRC-32C, computed
// with the CPU's CRC instructions (SSE 4.2, ARMv8) by hash/crc32.
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checksum is the checksum of one chunk, as recorded at seal and checked
// after every pull: CRC-32C. It guards against corruption, not against an
// attacker (the records' MACs and the authenticated control channel do
// that).
func Checksum(b []byte) uint32 { return crc32.Checksum(b, castagnoli) }

// ValidChunkSize reports whether c may be an object's chunk size: a power
// of two from MinChunkSize to MaxChunkSize.
func ValidChunkSize(c int64) bool {
	return c >= MinChunkSize && c <= MaxChunkSize && bits.OnesCount64(uint64(c)) == 1
}

// ChunkSizeFor returns the chunk size for an object of size bytes:
// DefaultChunkSize, doubled up to LargeChunkSize while the object has more
// than TargetChunks chunks, then doubled until it has at most MaxChunks.
func ChunkSizeFor(size int64) int64 {
	c := int64(DefaultChunkSize)
	for c < LargeChunkSize && (size+c-1)/c > TargetChunks {
		c *= 2
	}
	return ChunkSizeFrom(size, c)
}

// ChunkSizeFrom returns the chunk size for an object of size bytes
// starting from base (a power of two from MinChunkSize to MaxChunkSize):
// base, doubled until the object has at most MaxChunks chunks.
func ChunkSizeFrom(size, base int64) int64 {
	c := base
	for c < MaxChunkSize && (size+c-1)/c > MaxChunks {
		c *= 2
	}
	return c
}

// Checksums returns the chunk checksums of b for chunk size chunk.
func Checksums(b []byte, chunk int64) []uint32 {
	n := (int64(len(b)) + chunk - 1) / chunk
	sums := make([]uint32, 0, n)
	for off := int64(0); off < int64(len(b)); off += chunk {
		sums = append(sums, Checksum(b[off:min(off+chunk, int64(len(b)))]))
	}
	return sums
}

// ChecksumsParallel is Checksums spread over the CPUs (GOMAXPROCS), for a
// whole object at its seal: the same sums, in less time than one core takes.
func ChecksumsParallel(b []byte, chunk int64) []uint32 {
	chunks := int((int64(len(b)) + chunk - 1) / chunk)
	workers := min(runtime.GOMAXPROCS(0), chunks)
	if workers <= 1 {
		return Checksums(b, chunk)
	}
	sums := make([]uint32, chunks)
	per := (chunks + workers - 1) / workers
	var wg sync.WaitGroup
	for w := range workers {
		lo, hi := w*per, min((w+1)*per, chunks)
		if lo >= hi {
			break
		}
		wg.Go(func() {
			start := int64(lo) * chunk
			end := min(int64(hi)*chunk, int64(len(b)))
			copy(sums[lo:hi], Checksums(b[start:end], chunk))
		})
	}
	wg.Wait()
	return sums
}

// Node is a daemon's record in the directory: how other daemons reach it.
// It lives on the node's etcd lease, so it vanishes when the node stops
// renewing it.
type Node struct {
	// Name is the node's name (--node), unique in the cluster.
	Name string `json:"name"`
	// Worker is the node's UCX worker address (binary, opaque), for
	// diagnostics only; daemons leave it out. Over UCX's tcp and shared
	// memory transports a worker address lets whoever can reach the worker
	// read any of its process's memory, so readers get it from the holder
	// over the authenticated control channel, never from the directory.
	Worker []byte `json:"worker,omitempty"`
	// Control is the host:port of the node's control service, where
	// daemons authenticate each other and exchange rkeys.
	Control string `json:"control"`
	// Started is when the node joined; a restarted node has a new one.
	Started time.Time `json:"started"`
}

// Object is a cluster-visible object's record: written once, when it is
// sealed on its first node, and removed when the name is deleted.
type Object struct {
	// Name is the object's name in its owner's namespace.
	Name string `json:"name"`
	// Owner is the uid that owns it; uids are matched across nodes by
	// number (docs/cluster.md, "Security").
	Owner uint32 `json:"owner"`
	// Shared objects may be read by every uid a node admits.
	Shared bool `json:"shared,omitempty"`
	// Version is the version of a versioned name (from 1), 0 for a plain
	// object; Shard and Shards place it in its version.
	Version uint64 `json:"version,omitempty"`
	Shard   uint32 `json:"shard,omitempty"`
	Shards  uint32 `json:"shards,omitempty"`
	// Keep is the keep_last its publisher created a versioned name with:
	// every node keeps only the name's newest Keep committed versions
	// (docs/cluster.md, "Retention"). 0 (and records written before the
	// field) leaves retention to each node.
	Keep uint32 `json:"keep,omitempty"`
	// Size is its length in bytes.
	Size int64 `json:"size"`
	// ChunkSize is the unit of pulls and checksums.
	ChunkSize int64 `json:"chunk"`
	// Sums are the CRC-32C checksums of its chunks, in order.
	Sums []uint32 `json:"sums"`
	// Manifest is a bundle's manifest (its safetensors header, the bytes
	// the store validated at seal), empty for a plain object: a reader
	// makes its replica a bundle with it, and finds tensors' byte ranges
	// in it (TensorSlice) without reading the object.
	Manifest []byte `json:"manifest,omitempty"`
	// GPU says the object lives in GPU memory on its origin: a reader
	// with a GPU makes its replica there (the bytes cross through pinned
	// host memory where UCX cannot read GPU memory: cluster/staging).
	GPU bool `json:"gpu,omitempty"`
	// ID names this incarnation of the name (random), so that a replica
	// of a deleted and re-put name is never taken for the new one.
	ID string `json:"id"`
	// Origin is the node that sealed it first.
	Origin string `json:"origin"`
	// Sealed is when it was sealed on its origin.
	Sealed time.Time `json:"sealed"`
}

// Entry is an object's record with its live holders, as the directory
// returns it.
type Entry struct {
	Object
	// Holders are the nodes that hold a replica of this incarnation, in
	// key order.
	Holders []string
	// Revision is the record's revision in the directory: records are
	// written once, so a record replaced (after the name was deleted, or
	// when no node held it) has another.
	Revision int64
}

// Latest is a versioned name's latest visible version.
type Latest struct {
	Name    string `json:"name"`
	Owner   uint32 `json:"owner"`
	Version uint64 `json:"version"`
	Shards  uint32 `json:"shards"`
	// Keep is the committing shard's Object.Keep: a node drops its
	// replicas of versions Version-Keep and older when it sees this
	// record; 0 leaves retention to each node.
	Keep uint32 `json:"keep,omitempty"`
	// Pruned is the newest version whose records the commits of this
	// name have deleted (the directory keeps only the newest few): a
	// holder of an older version sees from it that its record went by a
	// commit, not by someone without the secret, and does not write it
	// back. 0: none pruned.
	Pruned uint64 `json:"pruned,omitempty"`
}

// MaxTombstoneIDs bounds the incarnations one tombstone names.
const MaxTombstoneIDs = 4096

// Tombstone is the owner's deletion of a name, as every holder verifies
// it: a holder drops its replica of an incarnation only when a tombstone
// sealed with the cluster secret names it, never because a record went
// from the directory. It lives on a lease of its own (tombstones expire).
type Tombstone struct {
	Owner uint32 `json:"owner"`
	Name  string `json:"name"`
	// IDs are the incarnations deleted: every shard of every version of a
	// versioned name, and those of earlier deletes of the name whose
	// tombstones had not expired.
	IDs []string `json:"ids"`
	// Node is the node the owner deleted the name on.
	Node    string    `json:"node"`
	Deleted time.Time `json:"deleted"`
}

// Ref names one object of the cluster: a plain object (Version 0) or one
// shard of one version of a versioned name, in its owner's namespace.
type Ref struct {
	Owner   uint32
	Name    string
	Version uint64
	Shard   uint32
}

// String is how logs and errors name an object: "UID:NAME", with
// "@vVERSION" and "#SHARD" for a shard of a version.
func (r Ref) String() string {
	s := strconv.FormatUint(uint64(r.Owner), 10) + ":" + r.Name
	if r.Version != 0 {
		s += "@v" + strconv.FormatUint(r.Version, 10) + "#" + strconv.FormatUint(uint64(r.Shard), 10)
	}
	return s
}

// Ref returns the object's reference.
func (o *Object) Ref() Ref {
	return Ref{Owner: o.Owner, Name: o.Name, Version: o.Version, Shard: o.Shard}
}

// Holder says that a node holds a sealed replica of an object; it lives on
// that node's lease.
type Holder struct {
	Node string `json:"node"`
	// ID is the Object.ID of the replica held.
	ID string `json:"id"`
}

// Pin says that a reader is pulling from a holder: the holder keeps the
// replica (no eviction, no reuse of its memory) while the pin exists. It
// lives on the reader's lease, so a dead reader's pins go with it.
type Pin struct {
	Reader string    `json:"reader"`
	Holder string    `json:"holder"`
	ID     string    `json:"id"`
	Since  time.Time `json:"since"`
}

// record is what can be sealed into a directory value.
type record interface {
	*Node | *Object | *Latest | *Holder | *Pin | *Tombstone
	validate() error
}

// Seal encodes r as the value of directory key: magic, an HMAC over the
// key and body with the cluster secret, and the body (JSON). The key is
// inside the MAC, so a record copied to another key does not verify.
func Seal[R record](s Secret, key string, r R) ([]byte, error) {
	if !s.Valid() {
		return nil, fmt.Errorf("%w: no secret", ErrSecret)
	}
	if err := r.validate(); err != nil {
		return nil, err
	}
	body, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("cluster: encode record %s: %w", key, err)
	}
	out := make([]byte, 0, len(recordMagic)+macLen+len(body))
	out = append(out, recordMagic...)
	out = append(out, recordMAC(s, key, body)...)
	out = append(out, body...)
	if len(out) > MaxRecordLen {
		return nil, fmt.Errorf("%w: record %s is %d bytes, at most %d", ErrBadRecord, key, len(out), MaxRecordLen)
	}
	return out, nil
}

// Open decodes and authenticates the value of directory key into r. Any
// failure (short, wrong magic, bad MAC, bad JSON, invalid fields) wraps
// ErrBadRecord and names the key.
func Open[R record](s Secret, key string, val []byte, r R) error {
	if err := Verify(s, key, val); err != nil {
		return err
	}
	body := val[len(recordMagic)+macLen:]
	d := json.NewDecoder(bytes.NewReader(body))
	d.DisallowUnknownFields()
	if err := d.Decode(r); err != nil {
		return fmt.Errorf("%w: %s: %v", ErrBadRecord, key, err)
	}
	if d.More() {
		return fmt.Errorf("%w: %s: trailing data", ErrBadRecord, key)
	}
	if err := r.validate(); err != nil {
		return fmt.Errorf("%s: %w", key, err)
	}
	return nil
}

// Verify checks that val was sealed with s as the value of key, without
// decoding it: a record of any kind. It fails wrapping ErrBadRecord for a
// value that is no cudaipc record, and for one whose MAC does not verify
// (forged, copied from another key, or sealed with another secret).
func Verify(s Secret, key string, val []byte) error {
	if !s.Valid() {
		return fmt.Errorf("%w: no secret", ErrSecret)
	}
	if len(val) > MaxRecordLen {
		return fmt.Errorf("%w: %s: %d bytes, at most %d", ErrBadRecord, key, len(val), MaxRecordLen)
	}
	if len(val) < len(recordMagic)+macLen || !bytes.HasPrefix(val, recordMagic) {
		return fmt.Errorf("%w: %s: not a cudaipc record (%d bytes)", ErrBadRecord, key, len(val))
	}
	mac := val[len(recordMagic) : len(recordMagic)+macLen]
	body := val[len(recordMagic)+macLen:]
	if !hmac.Equal(mac, recordMAC(s, key, body)) {
		return fmt.Errorf("%w: %s: MAC does not verify (forged, or written with another cluster secret)", ErrBadRecord, key)
	}
	return nil
}

func recordMAC(s Secret, key string, body []byte) []byte {
	m := s.mac("record")
	m.Write([]byte(key))
	m.Write([]byte{0})
	m.Write(body)
	return m.Sum(nil)
}

func bad(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrBadRecord}, args...)...)
}

// ValidateNodeName reports whether name may name a node: 1 to
// MaxNodeNameLen bytes of letters, digits, '-', '_' and '.', so that it
// fits in a directory key and a log line as it is.
func ValidateNodeName(name string) error {
	if name == "" || len(name) > MaxNodeNameLen {
		return fmt.Errorf("node name %q: 1 to %d characters", name, MaxNodeNameLen)
	}
	for _, r := range name {
		if r >= utf8.RuneSelf || !(unicode.IsLetter(r) || unicode.IsDigit(r) || r == '-' || r == '_' || r == '.') {
			return fmt.Errorf("node name %q: only ASCII letters, digits, '-', '_' and '.'", name)
		}
	}
	if name == "." || name == ".." {
		return fmt.Errorf("node name %q is reserved", name)
	}
	return nil
}

func validNode(name string) error {
	if err := ValidateNodeName(name); err != nil {
		return bad("%v", err)
	}
	return nil
}

func validName(name string) error {
	if err := protocol.ValidateName(name); err != nil {
		return bad("%v", err)
	}
	if _, _, ok := protocol.SplitOwner(name); ok {
		return bad("object name %q: a cluster name carries its owner as a field, not a UID: prefix", name)
	}
	return nil
}

// ValidateControlAddr reports whether a is a host:port with a numeric port.
func ValidateControlAddr(a string) error {
	host, port, err := net.SplitHostPort(a)
	if err != nil {
		return fmt.Errorf("control address %q: %v", a, err)
	}
	if host == "" {
		return fmt.Errorf("control address %q: no host", a)
	}
	if p, err := strconv.ParseUint(port, 10, 16); err != nil || p == 0 {
		return fmt.Errorf("control address %q: port must be 1-65535", a)
	}
	return nil
}

func (n *Node) validate() error {
	if err := validNode(n.Name); err != nil {
		return err
	}
	if len(n.Worker) > MaxWorkerAddrLen {
		return bad("node %s: UCX worker address of %d bytes (at most %d)", n.Name, len(n.Worker), MaxWorkerAddrLen)
	}
	if err := ValidateControlAddr(n.Control); err != nil {
		return bad("node %s: %v", n.Name, err)
	}
	return nil
}

func (o *Object) validate() error {
	if err := validName(o.Name); err != nil {
		return err
	}
	if err := protocol.ValidateSize(uint64(o.Size)); o.Size <= 0 || err != nil {
		return bad("object %s: size %d", o.Name, o.Size)
	}
	if !ValidChunkSize(o.ChunkSize) {
		return bad("object %s: chunk size %d is not a power of two in [%d, %d]", o.Name, o.ChunkSize, MinChunkSize, MaxChunkSize)
	}
	if n := (o.Size + o.ChunkSize - 1) / o.ChunkSize; n != int64(len(o.Sums)) {
		return bad("object %s: %d checksums for %d chunks", o.Name, len(o.Sums), n)
	}
	if len(o.Manifest) > MaxManifestLen {
		return bad("object %s: manifest of %d bytes (at most %d)", o.Name, len(o.Manifest), MaxManifestLen)
	}
	if err := validVersion(o.Name, o.Version, o.Shard, o.Shards); err != nil {
		return err
	}
	if err := validID(o.ID); err != nil {
		return bad("object %s: %v", o.Name, err)
	}
	return validNode(o.Origin)
}

func validVersion(name string, v uint64, shard, shards uint32) error {
	if v == 0 {
		if shard != 0 || shards != 0 {
			return bad("object %s: shard %d of %d without a version", name, shard, shards)
		}
		return nil
	}
	if shards == 0 || shards > MaxShards || shard >= shards {
		return bad("object %s: version %d: shard %d of %d (at most %d shards)", name, v, shard, shards, MaxShards)
	}
	return nil
}

// validID accepts what NewID makes: 32 lowercase hex digits.
func validID(id string) error {
	if len(id) != 32 {
		return fmt.Errorf("id %q is not 32 hex digits", id)
	}
	for i := 0; i < len(id); i++ {
		if c := id[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return fmt.Errorf("id %q is not 32 hex digits", id)
		}
	}
	return nil
}

func (l *Latest) validate() error {
	if err := validName(l.Name); err != nil {
		return err
	}
	if l.Version == 0 {
		return bad("latest of %s: version 0", l.Name)
	}
	return validVersion(l.Name, l.Version, 0, l.Shards)
}

func (t *Tombstone) validate() error {
	if err := validName(t.Name); err != nil {
		return err
	}
	if len(t.IDs) == 0 || len(t.IDs) > MaxTombstoneIDs {
		return bad("tombstone of %s: %d incarnations (1 to %d)", t.Name, len(t.IDs), MaxTombstoneIDs)
	}
	for _, id := range t.IDs {
		if err := validID(id); err != nil {
			return bad("tombstone of %s: %v", t.Name, err)
		}
	}
	return validNode(t.Node)
}

func (h *Holder) validate() error {
	if err := validNode(h.Node); err != nil {
		return err
	}
	if err := validID(h.ID); err != nil {
		return bad("holder %s: %v", h.Node, err)
	}
	return nil
}

func (p *Pin) validate() error {
	if err := validNode(p.Reader); err != nil {
		return err
	}
	if err := validNode(p.Holder); err != nil {
		return err
	}
	if err := validID(p.ID); err != nil {
		return bad("pin by %s: %v", p.Reader, err)
	}
	return nil
}

// NewID returns a random incarnation id for Object.ID.
func NewID() string {
	var b [16]byte
	rand.Read(b[:]) // never fails: crypto/rand crashes the program instead
	return hex.EncodeToString(b[:])
}
