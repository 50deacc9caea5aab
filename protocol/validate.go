package protocol

import (
	"strconv"
	"strings"
	"unicode"
	"unicode/utf8"

	"github.com/cudaipc/cudaipc/protocol/storev1"
)

// Limits on request arguments, enforced by ValidateRequest.
const (
	// MaxNameLen is the longest object name, in bytes.
	MaxNameLen = 255
	// MaxQualifiedNameLen is the longest name that addresses an object of
	// a given owner, "UID:NAME" (a uint32 has at most 10 digits).
	MaxQualifiedNameLen = MaxNameLen + 11
	// MaxObjectSize is the largest object, in bytes (1 TiB).
	MaxObjectSize = 1 << 40
	// MaxDeviceLen is the longest device string, in bytes.
	MaxDeviceLen = 64
	// MaxClientNameLen is the longest client name in a hello, in bytes.
	MaxClientNameLen = 255
)

// ValidateName reports whether name is a valid object name: 1 to MaxNameLen
// bytes of valid UTF-8, every character printable (unicode.IsPrint: letters,
// marks, numbers, punctuation, symbols and the ASCII space). '/' is allowed,
// so that names can be hierarchical ("model/layer.0"); names are keys, never
// file paths. The error is a *CodeError with code INVALID.
//
// A qualified name, "UID:NAME" (see SplitOwner), may be up to
// MaxQualifiedNameLen bytes, its NAME part up to MaxNameLen. A name that
// starts with digits and ':' names a uid, so its digits are the uid in
// canonical decimal (no leading zeros, no spaces, at most 2^32-1): "065534:x"
// or "65534 :x" would otherwise be plain names of their creator, shown to
// others as "0:065534:x". No name, nor the NAME of a qualified one, starts
// or ends with a space.
func ValidateName(name string) error {
	if name == "" {
		return Errorf(storev1.Error_INVALID, "empty object name")
	}
	if _, rest, ok := SplitOwner(name); ok && len(rest) <= MaxNameLen {
		// The prefix is ASCII digits and ':': only the rest needs checks.
	} else if len(name) > MaxNameLen {
		return Errorf(storev1.Error_INVALID, "object name is %d bytes, at most %d", len(name), MaxNameLen)
	}
	if !utf8.ValidString(name) {
		return Errorf(storev1.Error_INVALID, "object name %q is not valid UTF-8", name)
	}
	for i, r := range name {
		switch {
		case !unicode.IsPrint(r):
			return Errorf(storev1.Error_INVALID, "object name %q contains non-printable character %U at byte %d", name, r, i)
		}
	}
	bare := name
	if _, rest, ok := SplitOwner(name); ok {
		bare = rest
	}
	first, _ := utf8.DecodeRuneInString(bare)
	last, _ := utf8.DecodeLastRuneInString(name)
	if unicode.IsSpace(first) || unicode.IsSpace(last) {
		return Errorf(storev1.Error_INVALID, "object name %q starts or ends with a space: names may not (spaces inside a name are fine)", name)
	}
	if i := strings.IndexByte(bare, ':'); i > 0 && i < len(bare)-1 && strings.Trim(bare[:i], "0123456789 ") == "" {
		if _, _, ok := SplitOwner(bare); !ok {
			return Errorf(storev1.Error_INVALID, "object name %q: %q is not a uid in canonical decimal: a UID: prefix names that uid's namespace, as digits without leading zeros or spaces (65534:x)", name, bare[:i])
		}
	}
	return nil
}

// ValidateSize reports whether size is a valid object size: 1 to
// MaxObjectSize bytes. The error is a *CodeError with code INVALID.
func ValidateSize(size uint64) error {
	if size == 0 {
		return Errorf(storev1.Error_INVALID, "object size is 0")
	}
	if size > MaxObjectSize {
		return Errorf(storev1.Error_INVALID, "object size %d exceeds the maximum of %d bytes", size, uint64(MaxObjectSize))
	}
	return nil
}

// ValidateDevice reports whether device is well-formed: empty (meaning
// host), or at most MaxDeviceLen printable ASCII characters without spaces
// ("host", "0", "GPU-<uuid>"). Whether the device exists is for the server
// to say. The error is a *CodeError with code INVALID.
func ValidateDevice(device string) error {
	if len(device) > MaxDeviceLen {
		return Errorf(storev1.Error_INVALID, "device is %d bytes, at most %d", len(device), MaxDeviceLen)
	}
	for i := 0; i < len(device); i++ {
		if c := device[i]; c <= ' ' || c > '~' {
			return Errorf(storev1.Error_INVALID, "device %q contains byte %#02x; only printable ASCII without spaces is allowed", device, c)
		}
	}
	return nil
}

// validateText checks a free-form string such as a client name.
func validateText(field, s string, max int) error {
	if len(s) > max {
		return Errorf(storev1.Error_INVALID, "%s is %d bytes, at most %d", field, len(s), max)
	}
	if !utf8.ValidString(s) {
		return Errorf(storev1.Error_INVALID, "%s is not valid UTF-8", field)
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return Errorf(storev1.Error_INVALID, "%s contains control character %U", field, r)
		}
	}
	return nil
}

// ValidateRequest checks a request received with nfiles attached file
// descriptors against the protocol's rules: a non-zero id, exactly one known
// body, no files, and valid arguments (names, sizes, devices). It does not
// check the hello's version (see CheckVersion) or anything that depends on
// the server's state. The error is a *CodeError with code INVALID, to be
// sent back with ErrorResponse.
func ValidateRequest(r *storev1.Request, nfiles int) error {
	if r == nil {
		return Errorf(storev1.Error_INVALID, "nil request")
	}
	if r.GetId() == 0 {
		return Errorf(storev1.Error_INVALID, "request id 0 is reserved for events")
	}
	switch r.GetBody().(type) {
	case *storev1.Request_Register, *storev1.Request_StageFiles, *storev1.Request_Create:
	default:
		if nfiles != 0 && (!BlockRequest(r) || nfiles > 1) {
			return Errorf(storev1.Error_INVALID, "requests carry no file descriptors (but register's, create's and a block request's bulk file), got %d", nfiles)
		}
	}
	if ok, err := validatePool(r, nfiles); ok {
		return err
	}
	switch b := r.GetBody().(type) {
	case *storev1.Request_Register:
		return ValidateRegister(b.Register, nfiles)
	case *storev1.Request_StageFiles:
		if nfiles < 1 || nfiles > MaxFiles {
			return Errorf(storev1.Error_INVALID, "stage_files: %d descriptors, want 1 to %d", nfiles, MaxFiles)
		}
		return nil
	case *storev1.Request_Files:
		if b.Files.GetLeaseId() == 0 {
			return Errorf(storev1.Error_INVALID, "files: lease id 0")
		}
		if b.Files.GetFrom() >= MaxPieces {
			return Errorf(storev1.Error_INVALID, "files: from %d: a registration has at most %d", b.Files.GetFrom(), MaxPieces)
		}
		return nil
	case *storev1.Request_Hello:
		if b.Hello.GetVersion() == 0 {
			return Errorf(storev1.Error_INVALID, "hello: version 0")
		}
		return validateText("hello: client_name", b.Hello.GetClientName(), MaxClientNameLen)
	case *storev1.Request_Create:
		c := b.Create
		if err := ValidateName(c.GetName()); err != nil {
			return err
		}
		if err := ValidateSize(c.GetSize()); err != nil {
			return err
		}
		if err := ValidateTensor(c.GetTensor(), c.GetSize()); err != nil {
			return err
		}
		if err := validateSources(c, nfiles); err != nil {
			return err
		}
		return ValidateDevice(c.GetDevice())
	case *storev1.Request_Seal:
		if err := ValidateName(b.Seal.GetName()); err != nil {
			return err
		}
		if r := b.Seal.GetRename(); r != "" {
			if err := ValidateName(r); err != nil {
				return err
			}
		}
		if n := len(b.Seal.GetWaitEvent()); n != 0 && n != eventDescriptorSize {
			return Errorf(storev1.Error_INVALID, "wait_event: %d bytes, want an event descriptor's %d", n, eventDescriptorSize)
		}
		if (b.Seal.GetRename() != "" || b.Seal.Tensor != nil) && b.Seal.GetVersion() != 0 {
			return Errorf(storev1.Error_INVALID, "seal: rename and tensor are for plain objects, not shards of a version")
		}
		return nil
	case *storev1.Request_Abort:
		return ValidateName(b.Abort.GetName())
	case *storev1.Request_Get:
		if err := ValidateName(b.Get.GetName()); err != nil {
			return err
		}
		return ValidateTensorNames(b.Get.GetTensors())
	case *storev1.Request_Release:
		if b.Release.GetLeaseId() == 0 {
			return Errorf(storev1.Error_INVALID, "release: lease id 0")
		}
		return nil
	case *storev1.Request_Delete:
		return ValidateName(b.Delete.GetName())
	case *storev1.Request_List:
		if s := b.List.GetStartAfter(); s != "" {
			return ValidateName(s)
		}
		return nil
	case *storev1.Request_Stat:
		return ValidateName(b.Stat.GetName())
	case *storev1.Request_Subscribe:
		return nil
	case *storev1.Request_ForgetArenas:
		return validateArenaIDs("forget_arenas", b.ForgetArenas.GetArenaIds())
	case *storev1.Request_LeaseTable:
		return nil
	case *storev1.Request_Withdraw:
		return ValidateName(b.Withdraw.GetName())
	case *storev1.Request_Notify:
		if n := len(b.Notify.GetPayload()); n > MaxNoticePayload {
			return Errorf(storev1.Error_INVALID, "notify: a payload of %d bytes (at most %d)", n, MaxNoticePayload)
		}
		return ValidateName(b.Notify.GetName())
	case *storev1.Request_KvRead:
		return validateKVRead(b.KvRead)
	case *storev1.Request_KvNotify:
		switch r := b.KvNotify; {
		case len(r.GetSpace()) == 0 || len(r.GetSpace()) > MaxSpaceSize:
			return Errorf(storev1.Error_INVALID, "kv_notify: a description of %d bytes, want 1 to %d", len(r.GetSpace()), MaxSpaceSize)
		case len(r.GetPayload()) > MaxNoticePayload:
			return Errorf(storev1.Error_INVALID, "kv_notify: a payload of %d bytes (at most %d)", len(r.GetPayload()), MaxNoticePayload)
		}
		return nil
	case *storev1.Request_KvCancel:
		if b.KvCancel.GetReadId() == 0 {
			return Errorf(storev1.Error_INVALID, "kv_cancel: read id 0")
		}
		return nil
	case nil:
		return Errorf(storev1.Error_INVALID, "request %d has no known operation", r.GetId())
	default:
		return Errorf(storev1.Error_INVALID, "request %d: unsupported operation %T", r.GetId(), b)
	}
}

// ValidateTensorNames checks the tensor names of a get (GetRequest.tensors):
// each non-empty and valid UTF-8, none given twice. Whether the bundle has
// them is for the server to say. The error is a *CodeError with code
// INVALID naming the tensor.
func ValidateTensorNames(names []string) error {
	if len(names) == 0 {
		return nil
	}
	seen := make(map[string]struct{}, len(names))
	for i, n := range names {
		switch {
		case n == "":
			return Errorf(storev1.Error_INVALID, "get: tensor name %d of %d is empty", i+1, len(names))
		case !utf8.ValidString(n):
			return Errorf(storev1.Error_INVALID, "get: tensor name %q is not valid UTF-8", n)
		}
		if _, dup := seen[n]; dup {
			return Errorf(storev1.Error_INVALID, "get: tensor %q is named twice", n)
		}
		seen[n] = struct{}{}
	}
	return nil
}

// CheckVersion returns nil when the server speaks the client's protocol
// version v, else a *CodeError with code VERSION to send back before
// closing the connection.
func CheckVersion(v uint32) error {
	if v != Version {
		return Errorf(storev1.Error_VERSION, "client speaks protocol version %d, server speaks %d", v, Version)
	}
	return nil
}

// RequestKind returns the name of r's operation ("hello", "create", ...), or
// "unknown"; it suits log fields and metric labels.
func RequestKind(r *storev1.Request) string {
	switch r.GetBody().(type) {
	case *storev1.Request_Hello:
		return "hello"
	case *storev1.Request_Create:
		return "create"
	case *storev1.Request_Seal:
		return "seal"
	case *storev1.Request_Abort:
		return "abort"
	case *storev1.Request_Get:
		return "get"
	case *storev1.Request_Release:
		return "release"
	case *storev1.Request_Delete:
		return "delete"
	case *storev1.Request_List:
		return "list"
	case *storev1.Request_Stat:
		return "stat"
	case *storev1.Request_Subscribe:
		return "subscribe"
	case *storev1.Request_ForgetArenas:
		return "forget_arenas"
	case *storev1.Request_Register:
		return "register"
	case *storev1.Request_LeaseTable:
		return "lease_table"
	case *storev1.Request_StageFiles:
		return "stage_files"
	case *storev1.Request_Files:
		return "files"
	case *storev1.Request_Withdraw:
		return "withdraw"
	case *storev1.Request_Notify:
		return "notify"
	case *storev1.Request_KvRead:
		return "kv_read"
	case *storev1.Request_KvCancel:
		return "kv_cancel"
	case *storev1.Request_KvNotify:
		return "kv_notify"
	}
	if k := poolKind(r); k != "" {
		return k
	}
	return "unknown"
}

// ValidateResponse checks a response received with nfiles attached file
// descriptors against the protocol's rules, as a client should before
// trusting it: id 0 for events; an error response has no body and no files;
// a success has one known body; placements are consistent (offset + size <=
// arena_size, writable for create and read-only for get, fd_attached exactly
// when one file is attached); names are valid. Accepted as well: unknown
// error codes and event kinds, which a newer server may send, and an error
// with id 0, which reports a connection-level failure just before the server
// closes the connection. The error is a *MessageError wrapping ErrMalformed.
func ValidateResponse(r *storev1.Response, nfiles int) error {
	if err := validateResponse(r, nfiles); err != nil {
		return &MessageError{Op: "validate", Err: ErrMalformed, Detail: err.Error()}
	}
	return nil
}

type invalid string

func (s invalid) Error() string { return string(s) }

func validateResponse(r *storev1.Response, nfiles int) error {
	if r == nil {
		return invalid("nil response")
	}
	if nfiles < 0 || nfiles > MaxFiles {
		return invalid("bad file count")
	}
	if r.GetError().GetCode() != storev1.Error_OK {
		// Id 0 is allowed here: a connection-level error (a packet the
		// server could not decode) sent just before the server closes.
		if r.GetBody() != nil {
			return invalid("error response with a body")
		}
		if nfiles != 0 {
			return invalid("error response with files attached")
		}
		return nil
	}
	var isEvent bool
	switch r.GetBody().(type) {
	case *storev1.Response_Event, *storev1.Response_ArenasFreed, *storev1.Response_Notice:
		isEvent = true
	}
	if (r.GetId() == 0) != isEvent {
		return invalid("id 0 is for events (arenas_freed and notices too) only")
	}
	placementFiles := 0
	if files, ok, err := validatePoolResponse(r); ok {
		if err != nil {
			return err
		}
		if nfiles != files {
			return invalid("a pool's response with the wrong number of descriptors")
		}
		return nil
	}
	switch b := r.GetBody().(type) {
	case *storev1.Response_Hello:
		if b.Hello.GetVersion() == 0 {
			return invalid("hello: version 0")
		}
	case *storev1.Response_Create:
		if err := validatePlacement(b.Create.GetPlacement(), true); err != nil {
			return err
		}
		if b.Create.GetPlacement().GetFdAttached() {
			placementFiles = 1
		}
		if b.Create.GetManifestAttached() {
			placementFiles++
		}
	case *storev1.Response_Get:
		g := b.Get
		if g.GetLeaseId() == 0 {
			return invalid("get: lease id 0")
		}
		if err := validatePlacement(g.GetPlacement(), false); err != nil {
			return err
		}
		if g.GetPlacement().GetFdAttached() {
			placementFiles = 1
		}
		if g.GetPlacement().GetExternal() {
			if err := validateExternal(g.GetPlacement(), g.GetInfo()); err != nil {
				return err
			}
			placementFiles = min(int(g.GetPlacement().GetFiles()), AttachedFiles(g.GetManifestAttached()))
		}
		if g.GetInfo().GetSourcesSize() != 0 && !g.GetManifestAttached() {
			return invalid("get: a no-copy version without its manifest and sources table")
		}
		if g.GetManifestAttached() {
			if g.GetInfo().GetManifestSize() == 0 {
				return invalid("get: a manifest attached without its size")
			}
			placementFiles++
		}
		if err := validateInfo(g.GetInfo()); err != nil {
			return err
		}
		if g.GetInfo().GetSize() != g.GetPlacement().GetSize() {
			return invalid("get: info and placement sizes differ")
		}
		if g.GetLeaseSlot() > MaxLeaseSlots || (g.GetLeaseSlot() == 0) != (g.GetLeaseGen() == 0) || g.GetLeaseGen() > MaxSlotGen {
			return invalid("get: bad lease slot")
		}
	case *storev1.Response_List:
		for _, o := range b.List.GetObjects() {
			if err := validateInfo(o); err != nil {
				return err
			}
		}
	case *storev1.Response_Stat:
		if err := validateInfo(b.Stat.GetInfo()); err != nil {
			return err
		}
	case *storev1.Response_Event:
		if err := ValidateName(b.Event.GetName()); err != nil {
			return invalid("event: " + err.Error())
		}
	case *storev1.Response_LeaseTable:
		if n := b.LeaseTable.GetSlots(); n == 0 || n > MaxLeaseSlots {
			return invalid("lease_table: bad slot count")
		}
		placementFiles = 1
	case *storev1.Response_ArenasFreed:
		if err := validateArenaIDs("arenas_freed", b.ArenasFreed.GetArenaIds()); err != nil {
			return invalid(err.Error())
		}
	case *storev1.Response_Notice:
		if err := ValidateName(b.Notice.GetName()); err != nil {
			return invalid("notice: " + err.Error())
		}
		if len(b.Notice.GetPayload()) > MaxNoticePayload {
			return invalid("notice: payload too long")
		}
	case *storev1.Response_Register:
		if err := validateInfo(b.Register.GetInfo()); err != nil {
			return err
		}
	case *storev1.Response_StageFiles:
		if s := b.StageFiles.GetStaged(); s == 0 || s > MaxPieces {
			return invalid("stage_files: bad count")
		}
	case *storev1.Response_Files:
		n := b.Files.GetCount()
		if n == 0 || n > MaxFiles || b.Files.GetFrom() >= MaxPieces {
			return invalid("files: bad range")
		}
		placementFiles = int(n)
	case *storev1.Response_KvRead:
		if b.KvRead.GetLayers() > MaxKVLayers {
			return invalid("kv_read: bad layer count")
		}
	case *storev1.Response_Seal, *storev1.Response_Abort, *storev1.Response_Release,
		*storev1.Response_Delete, *storev1.Response_Subscribe, *storev1.Response_ForgetArenas, *storev1.Response_Withdraw,
		*storev1.Response_Notify, *storev1.Response_KvCancel, *storev1.Response_KvNotify:
	case nil:
		return invalid("success response without a known body")
	default:
		return invalid("unsupported response body")
	}
	if nfiles != placementFiles {
		return invalid("file count does not match fd_attached and manifest_attached")
	}
	return nil
}

func validatePlacement(p *storev1.Placement, writable bool) error {
	switch {
	case p == nil:
		return invalid("missing placement")
	case p.GetWritable() != writable:
		return invalid("placement has the wrong access mode")
	case ValidateSize(p.GetSize()) != nil:
		return invalid("placement: bad size")
	case p.GetArenaSize() < p.GetSize() || p.GetOffset() > p.GetArenaSize()-p.GetSize():
		return invalid("placement: object extends past the arena")
	case ValidateDevice(p.GetDevice()) != nil:
		return invalid("placement: bad device")
	}
	host := p.GetDevice() == "host"
	if p.GetExternal() {
		// Registered memory (validateExternal checks the rest): a vmm-fd
		// region with its descriptors beside the placement, or a cuda-ipc
		// region.
		// A no-copy version's create has nothing to map: no descriptors.
		// Registered host memory is its memfd, beside the placement.
		if k := p.GetKind(); k == storev1.Placement_HOST {
			if !host || p.GetFiles() != 1 || len(p.GetRegion()) != 0 {
				return invalid("placement: external host memory is one memfd on device host, without a region")
			}
			return nil
		}
		if k := p.GetKind(); host || k != storev1.Placement_VMM_FD && k != storev1.Placement_CUDA_IPC ||
			(k == storev1.Placement_VMM_FD) != (p.GetFiles() > 0) && !(writable && p.GetFiles() == 0 && len(p.GetRegion()) == 0) {
			return invalid("placement: an external placement is VMM_FD with descriptors or CUDA_IPC without")
		}
		return nil
	}
	if p.GetFiles() != 0 {
		return invalid("placement: descriptors of external memory in an arena's placement")
	}
	switch p.GetKind() {
	case storev1.Placement_HOST:
		if !host || len(p.GetRegion()) != 0 {
			return invalid("placement: a host placement is on device host and has no region")
		}
	case storev1.Placement_CUDA_IPC, storev1.Placement_VMM_FD:
		if host || len(p.GetRegion()) == 0 {
			return invalid("placement: a GPU placement is on a GPU and has a region")
		}
		if p.GetFdAttached() != (p.GetKind() == storev1.Placement_VMM_FD) {
			return invalid("placement: a vmm-fd placement, and only one, carries its arena's descriptor")
		}
	default:
		return invalid("placement: unknown kind")
	}
	return nil
}

func validateInfo(o *storev1.ObjectInfo) error {
	if o == nil {
		return invalid("missing object info")
	}
	if err := ValidateName(o.GetName()); err != nil {
		return invalid("object info: " + err.Error())
	}
	if ValidateSize(o.GetSize()) != nil {
		return invalid("object info: bad size")
	}
	if ValidateDevice(o.GetDevice()) != nil {
		return invalid("object info: bad device")
	}
	return nil
}

// MaxArenaIDs bounds the arena ids of one ForgetArenasRequest or
// ArenasFreed.
const MaxArenaIDs = 1024

// MaxNoticePayload bounds a notice's payload (NotifyRequest).
const MaxNoticePayload = 4096

// MaxPendingNotices bounds the notices a daemon keeps for one exporter's
// connection before sending them: a notify beyond it fails with LIMIT.
const MaxPendingNotices = 4096

func validateArenaIDs(what string, ids []uint64) error {
	if len(ids) == 0 || len(ids) > MaxArenaIDs {
		return Errorf(storev1.Error_INVALID, "%s: %d arena ids, want 1 to %d", what, len(ids), MaxArenaIDs)
	}
	for _, id := range ids {
		if id == 0 {
			return Errorf(storev1.Error_INVALID, "%s: arena id 0", what)
		}
	}
	return nil
}

// SplitOwner splits a qualified name, "UID:NAME", into the owner's uid and
// the name in that owner's namespace. UID is a uint32 in decimal without
// leading zeros and NAME is not empty; anything else (including "007:x" and
// "model:v1") is not qualified, and ok is false.
//
// Each uid has its own namespace: a bare name addresses the caller's own
// object, and "UID:NAME" the object NAME of uid UID (docs/protocol.md,
// section 6).
func SplitOwner(name string) (uid uint32, rest string, ok bool) {
	i := strings.IndexByte(name, ':')
	if i <= 0 || i > 10 || i == len(name)-1 || (name[0] == '0' && i > 1) {
		return 0, name, false
	}
	for j := range i {
		if name[j] < '0' || name[j] > '9' {
			return 0, name, false
		}
	}
	n, err := strconv.ParseUint(name[:i], 10, 32)
	if err != nil {
		return 0, name, false
	}
	return uint32(n), name[i+1:], true
}

// QualifiedName returns "UID:NAME", the name of an object of uid in any
// namespace.
func QualifiedName(uid uint32, name string) string {
	return strconv.FormatUint(uint64(uid), 10) + ":" + name
}

// ValidateRegister checks a register request carrying nfiles descriptors:
// a valid name, size, device and tensor, a region (which the store decodes:
// this package does not read regions) or for host memory one descriptor,
// at most MaxPieces descriptors in all and no more on the packet than the
// request says (the rest are staged on the connection: the store checks
// the total), and a space description of at most MaxSpaceSize bytes.
func ValidateRegister(r *storev1.RegisterRequest, nfiles int) error {
	if err := ValidateName(r.GetName()); err != nil {
		return err
	}
	if err := ValidateSize(r.GetSize()); err != nil {
		return err
	}
	if err := ValidateTensor(r.GetTensor(), r.GetSize()); err != nil {
		return err
	}
	if err := ValidateDevice(r.GetDevice()); err != nil {
		return err
	}
	switch n := r.GetFiles(); {
	case len(r.GetSpace()) > MaxSpaceSize:
		return Errorf(storev1.Error_INVALID, "register: a space description of %d bytes, at most %d", len(r.GetSpace()), MaxSpaceSize)
	case r.GetDevice() == "host" && (len(r.GetRegion()) != 0 || n != 1):
		return Errorf(storev1.Error_INVALID, "register: host memory is one memfd and no region, not %d descriptors and a region of %d bytes", n, len(r.GetRegion()))
	case r.GetDevice() != "host" && len(r.GetRegion()) == 0:
		return Errorf(storev1.Error_INVALID, "register: no region: send the memory's binary region (docs/region.md)")
	case n > MaxPieces:
		return Errorf(storev1.Error_INVALID, "register: %d descriptors, at most %d", n, MaxPieces)
	case nfiles > int(n) || nfiles > MaxFiles:
		return Errorf(storev1.Error_INVALID, "register: the request says %d descriptors and carries %d", n, nfiles)
	}
	return nil
}

// validateExternal checks the placement of a registered object.
func validateExternal(p *storev1.Placement, in *storev1.ObjectInfo) error {
	switch {
	case !in.GetExternal():
		return invalid("get: an external placement for an object that is not external")
	case (len(p.GetRegion()) == 0) == (in.GetSourcesSize() == 0) && p.GetKind() != storev1.Placement_HOST:
		return invalid("get: an external placement has its region or, for a no-copy version, a sources table")
	case p.GetFiles() > MaxPieces || p.GetFdAttached():
		return invalid("get: bad external descriptors")
	case p.GetOffset() != 0 || p.GetArenaSize() != p.GetSize():
		return invalid("get: an external placement is its whole region")
	}
	return nil
}

// eventDescriptorSize is cudaipc.EventDescriptorBinarySize (a test checks
// they agree; this package does not import the root one).
const eventDescriptorSize = 124

// MaxSourcesSize bounds a no-copy version's sources table: 65,536 regions
// of the largest binary encoding (version 2 over MaxPieces pieces) fit.
const MaxSourcesSize = 64 << 20

// validateSources checks the no-copy fields of a create carrying nfiles
// descriptors (docs/protocol.md section 6.8).
func validateSources(c *storev1.CreateRequest, nfiles int) error {
	n := c.GetSourcesSize()
	switch {
	case n == 0 && c.GetLikeVersion() != 0:
		return Errorf(storev1.Error_INVALID, "create: like_version is for a no-copy version: set sources_size")
	case n == 0 && (c.GetFiles() != 0 || nfiles != 0):
		return Errorf(storev1.Error_INVALID, "create: descriptors come only with a sources table (sources_size)")
	case n == 0:
		return nil
	case !c.GetVersioned() || c.GetManifestSize() == 0:
		return Errorf(storev1.Error_INVALID, "create: a sources table is for a version of a bundle: set versioned and manifest_size")
	case n > MaxSourcesSize:
		return Errorf(storev1.Error_INVALID, "create: sources table of %d bytes, at most %d", n, MaxSourcesSize)
	case c.GetFiles() > MaxPieces || nfiles > int(c.GetFiles()):
		return Errorf(storev1.Error_INVALID, "create: the request says %d descriptors (at most %d) and carries %d", c.GetFiles(), MaxPieces, nfiles)
	case c.GetDevice() == "" || c.GetDevice() == "host":
		return Errorf(storev1.Error_INVALID, "create: a sources table describes GPU memory: name its GPU's UUID")
	case c.GetTensor() != nil:
		return Errorf(storev1.Error_INVALID, "create: a no-copy version is a bundle: its manifest describes the tensors, not a tensor descriptor")
	case c.GetLikeVersion() != 0 && (c.GetFiles() != 0 || nfiles != 0 || c.GetShards() > 1):
		return Errorf(storev1.Error_INVALID, "create: like_version republishes a version of cuda-ipc regions: no descriptors, one shard")
	}
	return nil
}

// AttachedFiles is how many of an external placement's descriptors its get
// carries, the rest coming by files requests: a packet's MaxFiles, less
// one when the manifest's memfd travels with them (a no-copy version).
func AttachedFiles(manifest bool) int {
	if manifest {
		return MaxFiles - 1
	}
	return MaxFiles
}

// MaxKVLayers bounds the layers of a KV space (kv.MaxLayers), and so a
// kv_read's first and count.
const MaxKVLayers = 1024

// validateKVRead checks what a kv_read carries that needs no decoding of
// its descriptions (the daemon decodes and checks those against each
// other and the block ids): both present, at most MaxSpaceSize bytes, as
// many source as destination blocks and at least one, layers in bounds.
func validateKVRead(r *storev1.KvReadRequest) error {
	switch {
	case len(r.GetSrc()) == 0 || len(r.GetSrc()) > MaxSpaceSize:
		return Errorf(storev1.Error_INVALID, "kv_read: source description of %d bytes, want 1 to %d", len(r.GetSrc()), MaxSpaceSize)
	case len(r.GetDst()) == 0 || len(r.GetDst()) > MaxSpaceSize:
		return Errorf(storev1.Error_INVALID, "kv_read: destination description of %d bytes, want 1 to %d", len(r.GetDst()), MaxSpaceSize)
	case len(r.GetSrcBlocks()) == 0 || len(r.GetSrcBlocks()) != len(r.GetDstBlocks()):
		return Errorf(storev1.Error_INVALID, "kv_read: %d source and %d destination blocks: want as many, at least one", len(r.GetSrcBlocks()), len(r.GetDstBlocks()))
	case r.GetFirst() >= MaxKVLayers || r.GetCount() > MaxKVLayers:
		return Errorf(storev1.Error_INVALID, "kv_read: layers from %d, %d of them: a space has at most %d", r.GetFirst(), r.GetCount(), MaxKVLayers)
	}
	return nil
}
